"""`loraplex demo`'s terminal UI, headless, over a real AsyncEngine on a tiny model: every pane streams the
text its own adapter makes (equal to the offline engine's greedy text, so the panes are not mixed up), the
panes share the engine's steps, a pane whose request fails shows the error while the others finish, the
keys work, --once exits; the plain-text mode for pipes; and the command's flags."""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import time
from types import SimpleNamespace

import pytest
from server_fixtures import SERVER_ENGINE, make_text_model

from loraplex import LLM, SamplingParams
from loraplex.cli_commands import CommandError
from loraplex.config import EngineConfig
from loraplex.demo import assets, demo_command
from loraplex.demo.demo_command import add_demo_parser, demo_cmd
from loraplex.demo.streams import run_plain
from loraplex.demo.tui import DemoApp, PaneSpec, StepMonitor, printable
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import StepInfo

MAX_TOKENS = 24
PANES = [PaneSpec("base model", None, "Once upon a time"), PaneSpec("poet", "poet", "Roses are red"),
         PaneSpec("coder", "coder", "def main():"), PaneSpec("quotes", "quotes", "To be or not")]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    # (the tiny random model emits its eos token now and then: runs have a known length)
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def reference(model):
    """Each pane's greedy text, each request run alone through the offline `LLM`."""
    base, adapters = model
    with LLM(str(base), adapters=adapters, **SERVER_ENGINE) as llm:
        return {spec.adapter: llm.generate(spec.prompt, greedy(), adapter=spec.adapter, use_tqdm=False)[0].text
                for spec in PANES}


@pytest.fixture
def engine(model):
    base, adapters = model
    monitor = StepMonitor()
    engine = AsyncEngine(EngineConfig(str(base), **SERVER_ENGINE), adapters, observer=monitor)
    yield engine, monitor
    engine.shutdown()


async def _until(pilot, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.05)


def test_panes_stream_their_own_adapters_text_in_shared_batches(engine, reference):
    async_engine, monitor = engine
    app = DemoApp(async_engine, PANES, greedy(), loop_forever=False, monitor=monitor, refresh_s=0.05)

    async def run() -> None:
        async with app.run_test(size=(140, 40)) as pilot:
            await _until(pilot, lambda: app.finished)
            await pilot.pause(0.15)   # one more refresh shows the last text
            for i, spec in enumerate(PANES):
                assert reference[spec.adapter], spec
                assert app.pane_text(i) == printable(spec.prompt + reference[spec.adapter]), spec.title
                assert app.streams[i].status == "done" and app.streams[i].tokens == MAX_TOKENS
                assert f"{MAX_TOKENS} tokens" in app.pane_footer(i) and "tok/s" in app.pane_footer(i)
            stats = app.stats
            assert stats.total_tokens == MAX_TOKENS * len(PANES)
            assert stats.step.max_batch_size > 1          # the panes ran in the same steps
            assert len(stats.step.widest) >= 3            # adapters of several panes in one step
            assert set(stats.step.widest) <= {spec.adapter for spec in PANES}
            assert app.return_code is None
            await pilot.press("q")
            await pilot.pause()
            assert app.return_code == 0   # q asked the app to exit
        assert not app.is_running

    asyncio.run(run())


def test_a_failing_pane_shows_its_error_and_the_others_finish(engine, reference):
    async_engine, monitor = engine
    panes = [PANES[0], PaneSpec("ghost", "no-such-adapter", "Hello"), PANES[2]]
    app = DemoApp(async_engine, panes, greedy(), loop_forever=False, monitor=monitor, refresh_s=0.05)

    async def run() -> None:
        async with app.run_test(size=(120, 30)) as pilot:
            await _until(pilot, lambda: app.finished)
            await pilot.pause(0.15)
            assert app.streams[1].status == "error"
            assert "no-such-adapter" in app.pane_text(1) and "error" in app.pane_text(1)
            for i in (0, 2):
                assert app.pane_text(i) == printable(panes[i].prompt + reference[panes[i].adapter])
            await pilot.press("q")

    asyncio.run(run())


def test_pause_resume_and_restart_keys(engine):
    async_engine, monitor = engine
    app = DemoApp(async_engine, PANES[:2], greedy(64), loop_forever=False, monitor=monitor, refresh_s=0.05)

    async def run() -> None:
        async with app.run_test(size=(120, 30)) as pilot:
            await _until(pilot, lambda: all(s.tokens >= 2 for s in app.streams))
            await pilot.press("p")
            assert app.paused and [s.status for s in app.streams] == ["paused", "paused"]
            await pilot.pause(0.3)
            assert "PAUSED" in app.stats.describe()
            assert not async_engine.engine.has_unfinished()    # the requests in flight were aborted
            before = [(s.tokens, s.text) for s in app.streams]
            await pilot.press("p")                              # resume: each goes on from its text
            await _until(pilot, lambda: app.finished)
            for (tokens, text), st in zip(before, app.streams):
                assert tokens < 64 and st.tokens == 64 and st.runs == 1 and st.text.startswith(text)
            await pilot.press("r")                              # restart: a new generation each
            await _until(pilot, lambda: app.finished and all(s.runs == 2 for s in app.streams))
            assert [s.tokens for s in app.streams] == [64, 64]
            await pilot.press("q")

    asyncio.run(run())


def test_once_exits_when_every_stream_has_ended(engine, reference):
    async_engine, monitor = engine
    app = DemoApp(async_engine, PANES[:2], greedy(), loop_forever=False, monitor=monitor, refresh_s=0.05,
                  exit_when_done=True)

    async def run() -> None:
        async with app.run_test(size=(120, 30)) as pilot:
            await _until(pilot, lambda: not app.is_running)
        assert app.return_code == 0 and app.finished
        for i, spec in enumerate(PANES[:2]):
            assert app.streams[i].status == "done"
            line = app.describe(i)
            assert line.startswith(f"{spec.title} · adapter {spec.adapter or 'base'} · {MAX_TOKENS} tokens · ")
            assert line.endswith(f"length: {json.dumps(spec.prompt + reference[spec.adapter], ensure_ascii=False)}")

    asyncio.run(run())


def test_plain_mode_prints_a_line_per_stream_and_a_summary(engine, reference):
    async_engine, monitor = engine
    panes = [*PANES, PaneSpec("ghost", "no-such-adapter", "Hello")]
    out = io.StringIO()
    assert asyncio.run(run_plain(async_engine, panes, greedy(), monitor=monitor, out=out)) == 1   # ghost failed
    lines = out.getvalue().splitlines()
    assert len(lines) == len(panes) + 1 and "\x1b" not in out.getvalue()
    for spec in PANES:
        [line] = [ln for ln in lines if ln.startswith(f"{spec.title} · ")]
        assert line.endswith(f"length: {json.dumps(spec.prompt + reference[spec.adapter], ensure_ascii=False)}")
        assert f"· {MAX_TOKENS} tokens · " in line
    [ghost] = [ln for ln in lines if ln.startswith("ghost · ")]
    assert "error: " in ghost and "no-such-adapter" in ghost
    assert lines[-1].startswith(f"all streams: {MAX_TOKENS * len(PANES)} tokens in ")
    assert "in one step together: " in lines[-1]


def test_plain_text_escapes_newlines_and_escape_codes():
    from loraplex.demo.streams import describe_generation
    line = describe_generation(PaneSpec("p", "a", "x"), "\x1b[31mred\nline", 3, 1.0, "stop", None)
    assert line == 'p · adapter a · 3 tokens · 3.0 tok/s · stop: "x\\u001b[31mred\\nline"'
    assert "\n" not in line and "\x1b" not in line


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loraplex")
    add_demo_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_demo_flags():
    args = _parse(["demo"])
    assert (args.model, args.lora, args.prompt, args.max_tokens, args.temperature, args.top_p, args.device,
            args.dtype, args.once, args.plain) == (None, None, None, 128, 0.8, 0.95, None, None, False, False)
    assert args.func.__name__ == "demo_cmd"
    args = _parse(["demo", "--model", "m", "--lora", "a=/x", "--lora", "b=/y", "--prompt", "Hi",
                   "--max-tokens", "7", "--temperature", "0", "--top-p", "0.5", "--device", "cpu",
                   "--dtype", "float32", "--once", "--plain"])
    assert (args.model, args.lora, args.prompt, args.max_tokens, args.temperature, args.top_p, args.device,
            args.dtype, args.once, args.plain) == ("m", [("a", "/x"), ("b", "/y")], "Hi", 7, 0.0, 0.5, "cpu",
                                                   "float32", True, True)
    for bad in (["demo", "--lora", "nodir"], ["demo", "--dtype", "int8"], ["demo", "--max-tokens", "x"]):
        with pytest.raises(SystemExit):
            _parse(bad)


def test_step_monitor_counts_steps_not_idle_ticks():
    monitor = StepMonitor()
    every = (None, "coder", "poet")
    engine = SimpleNamespace(last_step=StepInfo(3, 3, every, True, False, 0.01), has_unfinished=lambda: True)
    monitor(engine)
    snap = monitor.snapshot()
    assert (snap.steps, snap.batch_size, snap.adapters, snap.max_batch_size) == (1, 3, every, 3)
    assert engine.last_step.num_adapters == 2   # the base model is not an adapter
    engine.last_step = StepInfo(2, 2, ("poet",), True, False, 0.01)
    monitor(engine)
    assert monitor.snapshot().adapters == ("poet",)
    engine.has_unfinished = lambda: False
    engine.last_step = StepInfo(1, 1, ("coder",), True, False, 0.01)
    monitor(engine)
    for _ in range(3):                               # idle ticks: last_step is left as it was
        monitor(engine)
    snap = monitor.snapshot()
    assert (snap.steps, snap.batch_size, snap.adapters, snap.widest) == (3, 0, (), every)


def _run_cmd(argv: list[str], monkeypatch) -> list:
    shown = []
    monkeypatch.setattr(demo_command, "_is_terminal", lambda: True)   # pytest's stdout is not a terminal
    monkeypatch.setattr(DemoApp, "run", lambda app: shown.append((app.panes, app.params, app.loop_forever)))
    assert demo_cmd(_parse(argv)) == 0
    return shown


def test_demo_cmd_builds_the_engine_and_the_panes(model, monkeypatch):
    base, adapters = model
    [(panes, params, loop)] = _run_cmd(["demo", "--model", str(base), "--lora", f"poet={adapters['poet']}",
                                        "--lora", f"coder={adapters['coder']}", "--prompt", "Hi", "--once",
                                        "--device", "cpu", "--max-tokens", "5"], monkeypatch)
    assert panes == [PaneSpec("base model", None, "Hi"), PaneSpec("poet", "poet", "Hi"),
                     PaneSpec("coder", "coder", "Hi")]
    assert (params.max_tokens, params.temperature, params.top_p, loop) == (5, 0.8, 0.95, False)


def test_demo_cmd_prints_plain_text_when_not_on_a_terminal(model, monkeypatch, capsys):
    base, adapters = model
    monkeypatch.setattr(DemoApp, "run", lambda app: pytest.fail("the terminal UI ran in a pipe"))
    assert demo_cmd(_parse(["demo", "--model", str(base), "--lora", f"poet={adapters['poet']}", "--prompt", "Hi",
                            "--once", "--device", "cpu", "--max-tokens", "3"])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" · ")[0] for ln in lines[:-1]] in (["base model", "poet"], ["poet", "base model"])
    assert lines[-1].startswith("all streams: ")


def test_demo_cmd_refusals(tmp_path, monkeypatch):
    with pytest.raises(CommandError, match="not a folder"):
        demo_cmd(_parse(["demo", "--model", str(tmp_path / "nope")]))
    with pytest.raises(CommandError, match="is not a folder"):
        demo_cmd(_parse(["demo", "--model", str(tmp_path), "--lora", f"a={tmp_path / 'nope'}"]))
    with pytest.raises(CommandError, match="max_tokens"):
        demo_cmd(_parse(["demo", "--max-tokens", "0"]))

    def missing():
        raise assets.DemoModelMissing("the demo model is missing from /x")
    monkeypatch.setattr(assets, "demo_model_dir", missing)
    with pytest.raises(CommandError, match="built-in demo model is not available.*missing from /x"):
        demo_cmd(_parse(["demo"]))
