"""StructuredOutputsParams: exactly one constraint, types checked at the edge,
on SamplingParams and BeamSearchParams alike, importable without torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from encdec import BeamSearchParams, SamplingParams, StructuredOutputsParams
from encdec.sampling_params import StructuredOutputsParams as FromSamplingParams


def test_exported_from_encdec_and_sampling_params():
    assert StructuredOutputsParams is FromSamplingParams


@pytest.mark.parametrize("kwargs, error, match", [
    ({}, ValueError, "exactly one of json, regex, choice, grammar, json_object; got none"),
    (dict(regex="a", choice=["b"]), ValueError, "got regex, choice"),
    (dict(json="{not json"), ValueError, "structured_outputs.json is not valid JSON"),
    (dict(json=3), TypeError, "structured_outputs.json must be a JSON schema"),
    (dict(choice=[]), ValueError, "structured_outputs.choice must be a non-empty list"),
    (dict(choice="yes"), TypeError, "structured_outputs.choice must be a list of str"),
    (dict(choice=["a", 1]), ValueError, "structured_outputs.choice"),
    (dict(regex=5), TypeError, "structured_outputs.regex must be a str"),
    (dict(regex=""), ValueError, "must not be empty"),
    (dict(grammar="  "), ValueError, "must not be empty"),
    (dict(json_object="yes"), TypeError, "structured_outputs.json_object must be a bool"),
    (dict(json_object=False), ValueError, "got none"),
])
def test_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        StructuredOutputsParams(**kwargs)


def test_kinds_and_cache_key():
    assert StructuredOutputsParams(json='{"type": "integer"}').json == {"type": "integer"}
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    b = StructuredOutputsParams(json='{"a": 2, "b": 1}')
    assert a.key() == b.key() and a.kind == "json"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]
    assert StructuredOutputsParams(regex="a").key() != StructuredOutputsParams(grammar="a").key()


def test_on_sampling_and_beam_params():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == \
        StructuredOutputsParams(regex="a+")
    assert BeamSearchParams(4, structured_outputs={"choice": ["x"]}).structured_outputs.choice == ["x"]
    with pytest.raises(ValueError, match="unknown key"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(TypeError, match="structured_outputs must be StructuredOutputsParams"):
        BeamSearchParams(2, structured_outputs="a+")
    assert SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")).clone().structured_outputs.regex == "a"


def test_no_torch_no_xgrammar_on_import():
    code = ("import sys, encdec.structured_output.params, encdec.beam_search.params; "
            "assert 'torch' not in sys.modules and 'xgrammar' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
