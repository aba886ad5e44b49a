"""The `loraplex` command: the README's first command runs and checks itself."""
from loraplex.cli import main


def test_op_demo_runs_and_matches_the_float64_loop(capsys):
    assert main(["op-demo", "--iters", "1", "--requests", "5", "--hidden", "96"]) == 0
    out = capsys.readouterr().out
    assert "5 requests" in out and "error vs a float64 loop" in out
