"""Where messages go (pipeline/logs.py) and the trainers' step lines (pipeline/train/progress.py)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

from pipeline import logs
from pipeline.train import progress


@pytest.fixture
def restored():
    """The loggers `logs.setup` changes, given back after the test."""
    names = ["pipeline", logs.DETAIL, *logs.LIBRARIES]
    saved = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).propagate) for n in names}
    yield
    logging.captureWarnings(False)
    for name, (handlers, propagate) in saved.items():
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            handler.close()
        logger.handlers, logger.propagate = handlers, propagate


def test_processes_started_in_children_to_file_write_to_the_log_only(capfd, restored, tmp_path):
    logs.setup(tmp_path / "pipeline.log", main=True)
    with logs.children_to_file():  # how a vLLM engine core starts: a child process inheriting stdout and stderr
        subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"],
                       check=True)
    logs.log.info("back on the terminal")
    out, err = capfd.readouterr()
    text = (tmp_path / "pipeline.log").read_text()
    assert "child out" in text and "child err" in text and "back on the terminal" in text
    assert "child" not in out + err and "back on the terminal" in err


def test_library_records_and_warnings_reach_the_file_only(capsys, restored, tmp_path):
    routed = tmp_path / "pipeline.log"
    logs.setup(routed, main=True)  # in the test itself: pytest catches warnings anew for each phase of a test
    logging.getLogger("pipeline").info("our line")
    logging.getLogger("transformers.modeling_utils").warning("a library's advice")
    logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("`past_key_values` is deprecated", FutureWarning, stacklevel=1)
    logs.detail("01-sft: step 5: loss=1.2")
    terminal, file = capsys.readouterr().err, routed.read_text()
    assert "our line" in terminal and "our line" in file
    for text in ("a library's advice", "Setting accelerator to CPU", "past_key_values", "loss=1.2"):
        assert text in file and text not in terminal, text


def test_figures_and_scores_for_people():
    assert [logs.figure(x) for x in (12475, 118.34, 7.04, 0.6901, 3e-06, None)] == \
        ["12,475", "118", "7.0", "0.69", "3e-06", "-"]
    assert logs.scores({"gsm/exact_match,strict-match": 0.5, "gsm/exact_match,flexible-extract": 0.25}) == \
        "gsm exact_match: strict-match 0.500, flexible-extract 0.250"
    assert [logs.duration(s) for s in (4.4, 99, 185, 3725)] == ["4 s", "99 s", "3 min 05 s", "1 h 02 min"]


def test_one_line_per_logging_step_with_rate_and_eta(monkeypatch):
    clock = iter([100.0, 110.0, 120.0])
    monkeypatch.setattr(progress.time, "time", lambda: next(clock))
    lines = progress.StepLines("01-sft", terminal=True)
    state = SimpleNamespace(global_step=0, max_steps=200, num_input_tokens_seen=0, is_world_process_zero=True)
    lines.on_train_begin(None, state, None)
    state.global_step = 40
    line = lines.line(state, {"loss": 1.0937, "num_input_tokens_seen": 131_000, "rewards/margins": 0.25})
    assert line == "01-sft: step 40/200, loss 1.094, reward margin 0.250, 13,100 tokens/s, ETA 40 s"
    state.global_step = 200
    assert re.fullmatch(r"01-sft: step 200/200, loss 0\.500", lines.line(state, {"loss": 0.5}))
