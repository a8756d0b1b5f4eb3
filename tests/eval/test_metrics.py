"""metrics.jsonl on resume: cut back to the checkpoint's step in place, a torn last line dropped."""

import json

import pytest
from omegaconf import OmegaConf

from eval.metrics import MetricsLogError, RunLogger

CFG = OmegaConf.create({"wandb": {"mode": "disabled"}})


def write_log(path, steps, tail: bytes = b"") -> None:
    path.write_bytes(
        b"".join(json.dumps({"step": s, "loss": 1.0 / s}).encode() + b"\n" for s in steps) + tail
    )


def steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_cuts_back_to_the_checkpoint_step(tmp_path):
    write_log(tmp_path / "metrics.jsonl", range(1, 11))
    logger = RunLogger(CFG, tmp_path, 6, None, enabled=True)
    logger.log({"step": 7, "loss": 0.5})
    logger.close()
    assert steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("torn", [b'{"step": 9, "lo', b'{"step": 9, "loss": 0.1}', b"\x00\x00\x00"])
def test_torn_last_line_is_dropped_with_a_warning(tmp_path, torn):
    """What a crash or a full disk leaves: a partial record, a complete one without its newline (the
    next append would glue onto it), or the zeros some filesystems leave after a crash."""
    write_log(tmp_path / "metrics.jsonl", range(1, 9), tail=torn)
    with pytest.warns(UserWarning, match="line 9 is torn"):
        logger = RunLogger(CFG, tmp_path, 8, None, enabled=True)
    logger.log({"step": 9, "loss": 0.5})
    logger.close()
    assert steps(tmp_path / "metrics.jsonl") == list(range(1, 10))


def test_garbage_inside_the_log_stops_with_the_line_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_log(path, range(1, 4))
    path.write_bytes(path.read_bytes() + b"garbage\n" + b'{"step": 4}\n')
    with pytest.raises(MetricsLogError, match="line 4 of 5 is not a JSON record"):
        RunLogger(CFG, tmp_path, 4, None, enabled=True)
    assert path.read_bytes().count(b"\n") == 5  # untouched
