"""Jobs on a local Ray cluster (2 CPUs, 127.0.0.1, no dashboard): a 2-actor pool
gives the same rows as one process, survives an actor dying mid-job, and turns
bad rows into rows with an error (or fails the job with on_error="raise").

One cluster serves the module; its processes are gone after teardown. Every
job runs under a deadline, since the machine is shared and slow at times."""
from __future__ import annotations

import glob
import os
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from encdec import LLM, SamplingParams
from encdec.ray import LLMPredictor
from tests.ray import local_cluster
from tests.ray.local_cluster import deadline

pytestmark = [pytest.mark.ray,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
BART_KW = dict(kv_cache_memory=64 << 20, swap_space=0.05)
WHISPER_KW = dict(kv_cache_memory=128 << 20, swap_space=0.05)
SPEECH = os.path.join(os.path.dirname(__file__), "..", "data", "speech")
JOB_SECONDS = 300  # generous: other test suites share these 2 cores


@pytest.fixture(scope="module")
def cluster():
    """A quiet local cluster; teardown checks that all its processes exit."""
    import psutil

    temp_dir = local_cluster.start("encdec-ray-")
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ours = psutil.Process().children(recursive=True)  # gcs_server, raylet, workers, ...
    assert any("raylet" in p.name() for p in ours)
    try:
        yield
    finally:
        left = local_cluster.stop(ours, temp_dir)
        assert not left, f"Ray processes survived SIGKILL after ray.shutdown(): {left}"


def _prompts(n: int) -> list[str]:
    """Varied lengths and content, deterministic."""
    words = ("rain spain plain fox dog encoder decoder summary token batch cache block "
             "speech text numbers Ada Alan 1984 42 pages memory").split()
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(3 + i % 23)) for i in range(n)]


def _rows_by_id(rows: list[dict], n: int) -> list[dict]:
    """Rows sorted by id, after checking that each id in 0..n-1 came back exactly once."""
    ids = sorted(int(r["id"]) for r in rows)
    assert ids == list(range(n)), f"lost or duplicated rows: got {len(ids)} rows, {len(set(ids))} distinct"
    return sorted(rows, key=lambda r: int(r["id"]))


@pytest.fixture(scope="module")
def bart_job(tiny_bart):
    """200 prompts and what one process makes of them."""
    prompts = _prompts(200)
    llm = LLM(tiny_bart, **BART_KW)
    want = [o.outputs[0].text for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert len(set(want)) > 50  # varied outputs: equality below means something
    return prompts, want


def _bart_dataset(prompts, batch_size: int):
    """One block per batch, so that each Ray task is one engine call."""
    return ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)],
                               override_num_blocks=len(prompts) // batch_size)


def test_two_actors_generate_the_same_rows_as_one_process(cluster, tiny_bart, bart_job):
    prompts, want = bart_job
    ds = _bart_dataset(prompts, 25).map_batches(
        LLMPredictor, fn_constructor_kwargs=dict(model=tiny_bart, params=GREEDY, num_threads=1, **BART_KW),
        batch_size=25, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1)
    with deadline(JOB_SECONDS, "the BART job"):
        rows = _rows_by_id(ds.take_all(), len(prompts))
    assert [r["prompt"] for r in rows] == prompts  # input columns kept
    assert [r["generated_text"] for r in rows] == want


@pytest.mark.slow  # lean default run: `make test-all` runs it
def test_two_actors_transcribe_the_same_rows_as_one_process(cluster, ct2_dir):
    paths = sorted(glob.glob(os.path.join(SPEECH, "s*.wav")))[:12]
    assert len(paths) == 12
    want = LLM(str(ct2_dir), **WHISPER_KW).transcribe(paths, use_tqdm=False)
    # The files' bytes, as read from object storage (paths: test_predictor.py;
    # a column mixing both: below).
    items = [{"id": i, "audio": Path(p).read_bytes()} for i, p in enumerate(paths)]
    ds = ray.data.from_items(items).map_batches(
        LLMPredictor, fn_constructor_kwargs=dict(model=ct2_dir, task="transcribe", num_threads=1, **WHISPER_KW),
        batch_size=3, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1)
    with deadline(JOB_SECONDS, "the Whisper job"):
        rows = _rows_by_id(ds.take_all(), len(paths))
    assert [r["text"] for r in rows] == [t.text for t in want]
    assert [r["language"] for r in rows] == ["en"] * 12
    assert all(r["text"] for r in rows)


class CrashingPredictor(LLMPredictor):
    """Exits its process while working on its second batch, once per job (the
    marker file records the crash, so the restarted actor and its peer run
    normally). The batch's work is done and lost, as in an OOM kill."""

    def __init__(self, marker: str, **kwargs):
        super().__init__(**kwargs)
        self.marker, self.calls = marker, 0

    def __call__(self, batch):
        self.calls += 1
        out = super().__call__(batch)
        if self.calls == 2:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return out
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            os._exit(1)  # no cleanup, no exception: the process is gone
        return out


# max_restarts/max_task_retries have no named map_batches parameter in Ray 2.60:
# they go through ray_remote_args, which warns.
@pytest.mark.filterwarnings("ignore:`ray_remote_args` is deprecated")
def test_a_killed_actor_is_restarted_and_no_row_is_lost(cluster, tiny_bart, bart_job, tmp_path):
    prompts, want = bart_job[0][:80], bart_job[1][:80]  # 8 batches: enough for a crash mid-job
    # Ray's workers cannot import this test module: ship CrashingPredictor by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    marker = str(tmp_path / "crashed")
    ds = _bart_dataset(prompts, 10).map_batches(
        CrashingPredictor,
        fn_constructor_kwargs=dict(marker=marker, model=tiny_bart, params=GREEDY, num_threads=1, **BART_KW),
        batch_size=10, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1,
        # Bounded retries (Ray Data's default is forever): a crash loop fails the job.
        max_restarts=2, max_task_retries=3)
    started = time.monotonic()
    with deadline(JOB_SECONDS, "the BART job with a crash"):
        rows = _rows_by_id(ds.take_all(), len(prompts))
    assert os.path.exists(marker), "no actor crashed: the test proved nothing"
    crashed_pid = int(Path(marker).read_text())
    assert crashed_pid != os.getpid() and time.monotonic() - started < JOB_SECONDS
    assert [r["generated_text"] for r in rows] == want


BAD_ROWS = {17: {"prompt": None}, 88: {}, 150: {"prompt": ""}}  # no text, no column, empty text


def test_bad_rows_get_an_error_and_the_rest_of_their_batch_completes(cluster, tiny_bart, bart_job):
    prompts, want = bart_job
    items = [{"id": i, **BAD_ROWS.get(i, {"prompt": p})} for i, p in enumerate(prompts)]
    ds = ray.data.from_items(items, override_num_blocks=8).map_batches(
        LLMPredictor, fn_constructor_kwargs=dict(model=tiny_bart, params=GREEDY, num_threads=1, **BART_KW),
        batch_size=25, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1)
    with deadline(JOB_SECONDS, "the BART job with bad rows"):
        rows = _rows_by_id(ds.take_all(), len(prompts))
    assert len(rows) == 200
    for i, row in enumerate(rows):
        if i in BAD_ROWS:
            assert row["generated_text"] is None and row["error"], row
        else:
            assert row["error"] is None and row["generated_text"] == want[i], (i, row)
    assert "'prompt' must be text or a list of token ids, got NoneType" in rows[17]["error"]
    assert "'prompt' must be text" in rows[88]["error"]  # Arrow fills a missing key with null
    assert "empty" in rows[150]["error"]


def test_on_error_raise_fails_the_job(cluster, tiny_bart, bart_job):
    prompts = bart_job[0][:20]
    items = [{"id": i, "prompt": "" if i == 7 else p} for i, p in enumerate(prompts)]
    ds = ray.data.from_items(items, override_num_blocks=2).map_batches(
        LLMPredictor, fn_constructor_kwargs=dict(model=tiny_bart, params=GREEDY, num_threads=1,
                                                 on_error="raise", **BART_KW),
        batch_size=10, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1)
    with deadline(JOB_SECONDS, "the failing BART job"), pytest.raises(Exception) as e:
        ds.take_all()
    assert "refused a batch of 10 rows" in str(e.value) and "empty" in str(e.value)


@pytest.mark.slow  # lean default run: `make test-all` runs it
def test_a_column_mixing_bytes_and_paths_transcribes(cluster, ct2_dir):
    paths = sorted(glob.glob(os.path.join(SPEECH, "s*.wav")))[:4]
    want = LLM(str(ct2_dir), **WHISPER_KW).transcribe(paths, use_tqdm=False)
    items = [{"id": i, "audio": Path(p).read_bytes() if i % 2 else p} for i, p in enumerate(paths)]
    items.append({"id": 4, "audio": b"RIFF\0\0\0\0not a wav"})  # corrupt audio: its row's error
    ds = ray.data.from_items(items).map_batches(
        LLMPredictor, fn_constructor_kwargs=dict(model=ct2_dir, task="transcribe", num_threads=1, **WHISPER_KW),
        batch_size=5, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1)
    schema = ds.schema()
    assert str(dict(zip(schema.names, schema.types))["audio"]) == "binary"  # the paths became bytes
    with deadline(JOB_SECONDS, "the mixed-column Whisper job"):
        rows = _rows_by_id(ds.take_all(), 5)
    assert [r["text"] for r in rows[:4]] == [t.text for t in want] and all(r["text"] for r in rows[:4])
    assert [r["error"] for r in rows[:4]] == [None] * 4
    assert rows[4]["text"] is None and "cannot be decoded" in rows[4]["error"]
