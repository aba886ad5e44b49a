"""loraplex.envs: every LORAPLEX_* variable read, parsed and validated in one place."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex import envs

SRC = Path(envs.__file__).parent


@pytest.fixture
def clean_env(monkeypatch):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults(clean_env):
    assert envs.snapshot() == {"LORAPLEX_OPS_BACKEND": "auto", "LORAPLEX_PDL": "on", "LORAPLEX_SKINNY_GEMM": "auto",
                               "LORAPLEX_SKINNY_CONFIGS": "", "LORAPLEX_FP8_W8A8": "auto",
                               "LORAPLEX_FAST_LAUNCH": "auto"}
    assert (envs.ops_backend(), envs.pdl(), envs.triton_gemm(), envs.gemm_configs_path(), envs.fast_launch()) == \
        ("auto", True, "auto", None, "auto")


@pytest.mark.parametrize("value, want", [("", "on"), ("1", "on"), (" TRUE ", "on"), ("yes", "on"), ("On", "on"),
                                         ("0", "off"), ("false", "off"), ("No", "off"), ("off", "off")])
def test_switches_take_their_aliases_in_any_case(value, want, clean_env):
    clean_env.setenv("LORAPLEX_PDL", value)
    assert envs.get("LORAPLEX_PDL") == want and envs.pdl() is (want == "on")
    clean_env.setenv("LORAPLEX_SKINNY_GEMM", value)
    assert envs.triton_gemm() == ("auto" if value == "" else want)   # empty: unset, the default


def test_choices_and_paths(clean_env, tmp_path):
    clean_env.setenv("LORAPLEX_SKINNY_GEMM", " Auto ")
    clean_env.setenv("LORAPLEX_OPS_BACKEND", "Reference")
    clean_env.setenv("LORAPLEX_FAST_LAUNCH", "0")
    clean_env.setenv("LORAPLEX_FP8_W8A8", "YES")
    clean_env.setenv("LORAPLEX_SKINNY_CONFIGS", f" {tmp_path}/Tiles.json ")
    assert envs.snapshot() == {"LORAPLEX_OPS_BACKEND": "reference", "LORAPLEX_PDL": "on",
                               "LORAPLEX_SKINNY_GEMM": "auto", "LORAPLEX_SKINNY_CONFIGS": f"{tmp_path}/Tiles.json",
                               "LORAPLEX_FP8_W8A8": "on", "LORAPLEX_FAST_LAUNCH": "off"}
    assert envs.gemm_configs_path() == f"{tmp_path}/Tiles.json"   # a path keeps its case


def test_a_bad_value_names_the_variable_the_value_and_the_choices(clean_env):
    clean_env.setenv("LORAPLEX_SKINNY_GEMM", "sometimes")
    with pytest.raises(ValueError) as err:
        envs.triton_gemm()
    assert str(err.value) == "LORAPLEX_SKINNY_GEMM='sometimes': expected auto, on (or 1) or off (or 0)"
    clean_env.setenv("LORAPLEX_PDL", "2")
    with pytest.raises(ValueError, match=r"LORAPLEX_PDL='2': expected on \(or 1\) or off \(or 0\)"):
        envs.pdl()
    clean_env.setenv("LORAPLEX_OPS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="LORAPLEX_OPS_BACKEND='cuda': expected auto, triton or reference"):
        envs.ops_backend()
    with pytest.raises(ValueError, match="LORAPLEX_OPS_BACKEND='cuda'"):
        envs.snapshot()


def test_a_bad_value_read_at_import_stops_the_import():
    probe = "import loraplex.ops.gemm.skinny"
    bad = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, LORAPLEX_SKINNY_GEMM="maybe"),
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "LORAPLEX_SKINNY_GEMM='maybe'" in bad.stderr


def test_every_variable_is_documented_in_the_module_table():
    doc = envs.__doc__
    for name, var in envs.VARIABLES.items():
        row = next((line for line in doc.splitlines() if line.startswith(f"| {name} ")), None)
        assert row is not None, f"{name} has no row in envs.py's table"
        assert var.meaning
        for choice in var.choices or ():
            assert choice in row, f"{name}: {choice} missing from its row"


def test_no_other_module_reads_a_loraplex_variable():
    """Only envs.py reads LORAPLEX_* variables from the environment (os.environ / os.getenv)."""
    reads = re.compile(r"os\.(environ|getenv)")
    offenders = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py") if path.name != "envs.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if reads.search(line) and "LORAPLEX_" in line]
    assert not offenders, offenders
