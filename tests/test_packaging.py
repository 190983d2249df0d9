"""A non-editable install works: build the wheel, install it into a fresh venv
outside the checkout, and there generate, transcribe and run ``encdec bench``.

To stay offline and fast the new venv borrows this venv's dependencies (torch,
transformers, ...) through a ``.pth`` line, but not its editable encdec: the
wheel goes in with ``pip install --no-deps`` and the test checks that the
``encdec`` imported is the installed one. The wheel is built from a copy of the
package's files, so nothing lying around the checkout can leak into it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEECH = ROOT / "tests" / "data" / "speech"
pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 300) -> str:
    proc = subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A venv outside the checkout with the wheel installed; returns its python and env."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "encdec", src / "encdec", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
          str(src)], cwd=tmp)
    (wheel,) = dist.glob("encdec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernels = [f"encdec/kernels/cpu/{name}_cpu.{ext}" for name in ("dense_attention", "paged_attention",
               "small_linear", "greedy", "whisper_rules", "decoder_step") for ext in ("c", "py")]
    kernels += [f"encdec/kernels/cpu/{name}" for name in ("vector_math.h", "team.h", "build.py")]
    from encdec.entrypoints.openai.ui_routes import UI_FILES

    ui = [f"encdec/entrypoints/openai/ui/{name}" for name in UI_FILES]  # the web page at /
    for shipped in (*kernels, *ui, "encdec/bench/realtime_bench.py", "encdec/bench/swap_bench.py"):
        assert shipped in names, f"{shipped} missing from {wheel.name}"
    # The comparison harnesses (HF, CTranslate2, faster-whisper, jiwer) stay in the checkout.
    left_out = [n for n in names if n.startswith("benchmarks/") or n.endswith(("bart_bench.py", "whisper_bench.py"))]
    assert not left_out, f"{wheel.name} ships {left_out}"

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip())
    # This venv's packages as a fallback path; its .pth files (the editable
    # encdec's finder) are not processed from there.
    (site / "zz_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
         cwd=tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["ENCDEC_CACHE_DIR"] = str(tmp / "kernel_cache")  # the wheel's sources compile afresh
    run_dir = tmp / "elsewhere"
    run_dir.mkdir()
    return {"py": str(py), "bin": venv / "bin", "env": env, "cwd": run_dir, "venv": venv}


def _python(installed: dict, code: str) -> dict:
    out = _run([installed["py"], "-c", textwrap.dedent(code)], cwd=installed["cwd"], env=installed["env"])
    return json.loads(out.strip().splitlines()[-1])


def test_generates_with_the_installed_wheel(installed, tmp_path):
    got = _python(installed, f"""
        import json, encdec
        from encdec import LLM, SamplingParams
        from encdec.kernels.cpu import build, dense_attention_cpu, paged_attention_cpu, small_linear_cpu
        from encdec.testing import make_random_bart
        llm = LLM(make_random_bart({str(tmp_path / "bart")!r}, seed=0), kv_cache_memory=16 << 20, swap_space=0.01)
        out = llm.generate(["The rain in spain", "A quick brown fox"],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        print(json.dumps({{"file": encdec.__file__, "tokens": [o.outputs[0].token_ids for o in out],
                          "isa": build.cpu_isa(), "paged": paged_attention_cpu.available(),
                          "dense": dense_attention_cpu.available(), "small_linear": small_linear_cpu.path()}}))
    """)
    assert Path(got["file"]).is_relative_to(installed["venv"]), got["file"]
    assert [len(t) for t in got["tokens"]] == [8, 8]
    assert got["paged"], "the wheel's paged kernel source did not build"
    assert got["small_linear"] == got["isa"], "the wheel's small-row linear did not build for this ISA"
    if got["isa"] != "none":
        assert got["dense"], "the wheel's dense kernel source did not build"


def test_transcribes_a_shipped_clip(installed, ct2_dir):
    jiwer = pytest.importorskip("jiwer")
    got = _python(installed, f"""
        import json, encdec
        from encdec import LLM, SamplingParams, TextPrompt
        import soundfile as sf
        wav, sr = sf.read({str(SPEECH / "s00.wav")!r}, dtype="float32")
        llm = LLM({str(ct2_dir)!r}, kv_cache_memory=64 << 20, swap_space=0.01)
        prompt = TextPrompt(prompt="<|startoftranscript|><|notimestamps|>", multi_modal_data={{"audio": (wav, sr)}})
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
        print(json.dumps({{"file": encdec.__file__, "text": out[0].outputs[0].text}}))
    """)
    assert Path(got["file"]).is_relative_to(installed["venv"]), got["file"]
    truth = (SPEECH / "sentences.txt").read_text().splitlines()[0]
    norm = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation(), jiwer.RemoveMultipleSpaces(),
                          jiwer.Strip(), jiwer.ReduceToListOfListOfWords()])
    wer = jiwer.wer(truth, got["text"], reference_transform=norm, hypothesis_transform=norm)
    assert wer < 0.5, (truth, got["text"], wer)


def test_bench_help_runs_from_anywhere(installed):
    out = _run([str(installed["bin"] / "encdec"), "bench", "swap", "--help"], cwd=installed["cwd"], env=installed["env"])
    assert "usage: encdec bench swap" in out
    out = _run([str(installed["bin"] / "encdec"), "bench", "--help"], cwd=installed["cwd"], env=installed["env"])
    assert "whisper" in out
    proc = subprocess.run([str(installed["bin"] / "encdec"), "bench", "bart"], cwd=installed["cwd"],
                          env=installed["env"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "python -m benchmarks.bart_bench" in proc.stderr, proc.stderr


def test_the_web_page_is_read_from_the_wheel(installed):
    """``encdec serve``'s page comes from the installed package's files, not the checkout's."""
    got = _python(installed, """
        import json, encdec
        from encdec.entrypoints.openai.ui_routes import UI_FILES, _ui_file
        print(json.dumps({"file": encdec.__file__, "sizes": {n: len(_ui_file(n)) for n in UI_FILES}}))
    """)
    assert not got["file"].startswith(str(ROOT))
    assert got["sizes"] == {n: (ROOT / "encdec/entrypoints/openai/ui" / n).stat().st_size for n in got["sizes"]}


def test_benchmarks_are_found_by_name():
    from encdec import bench

    assert {"realtime", "serve", "swap", "encoder_cache", "ray"} <= set(bench.names())
    assert not {"bart", "whisper", "gpu"} & set(bench.names())
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        bench.run("nope", [])


def test_checkout_alias_runs_the_same_benchmarks():
    """``python -m benchmarks.NAME_bench`` in the checkout runs the harnesses there and
    the packaged benchmarks (encdec/bench/NAME_bench.py) alike."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = _run([sys.executable, "-m", "benchmarks.whisper_bench", "--help"], cwd=ROOT, env=env, timeout=120)
    assert "--audio-dir" in out
    out = _run([sys.executable, "-m", "benchmarks.swap_bench", "--help"], cwd=ROOT, env=env, timeout=120)
    assert "usage:" in out
