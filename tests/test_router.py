"""scripts/router_check.py: the pieces that need no server (fast; no network, no model).

The check itself (two `kvql serve` workers behind vllm-router, ~3 minutes, vllm-router from PyPI on first use)
runs only with KVQL_ROUTER_CHECK=1: `KVQL_ROUTER_CHECK=1 ./dev test tests/test_router.py`.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "router_check.py"


@pytest.fixture(scope="module")
def rc():
    spec = importlib.util.spec_from_file_location("router_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_adapter_drops_only_the_fields_the_router_adds_at_their_defaults(rc):
    sent = {"model": "m", "prompt": "p", "max_tokens": 4, "no_stop_trim": False, "ignore_eos": False,
            "skip_special_tokens": True, "return_hidden_states": False, "echo": False}
    assert rc.strip_router_defaults(sent) == {"model": "m", "prompt": "p", "max_tokens": 4, "echo": False}


def test_a_non_default_router_field_is_kept_so_kvql_refuses_it(rc):
    assert rc.strip_router_defaults({"ignore_eos": True, "skip_special_tokens": False}) == \
        {"ignore_eos": True, "skip_special_tokens": False}
    assert rc.strip_router_defaults({"ignore_eos": 0}) == {"ignore_eos": 0}  # only the router's exact values


def test_the_workloads_have_48_distinct_inputs_over_one_or_two_prefixes(rc):
    shared, two = rc.workload("shared", 48), rc.workload("two-task", 48)
    assert len(set(shared)) == len(set(two)) == 48
    assert {p for p, _ in shared} == {rc.QA_PREFIX}
    assert [p for p, _ in two].count(rc.QA_PREFIX) == [p for p, _ in two].count(rc.WORD_PREFIX) == 24
    assert rc.workload("two-task", 48) == two  # the mix is fixed


@pytest.mark.skipif(os.environ.get("KVQL_ROUTER_CHECK") != "1", reason="set KVQL_ROUTER_CHECK=1 (~3 min)")
def test_queries_through_vllm_router_answer_as_the_local_model():
    r = subprocess.run([sys.executable, str(SCRIPT), "--n", "8"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if "answers equal" in line]
    assert len(lines) == 4 and all("answers equal 8/8" in line for line in lines), r.stdout
