"""The console progress of a run: a tqdm bar on a terminal, plain lines every log_every steps elsewhere."""

import eval.metrics as metrics
from eval.metrics import Progress


def record(step: int) -> dict:
    return {"step": step, "loss": 4.0 + 1 / step, "lr_mult": 0.5, "tokens_per_s": 123456.7, "mfu": 0.412}


def test_without_a_terminal_one_plain_line_every_log_every_steps_and_at_the_end(capsys, monkeypatch):
    clock = iter(range(0, 1000, 2))  # every read of the clock is 2 s after the previous one
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    progress = Progress(total=10, initial=0, log_every=3, enabled=True, interactive=False)  # clock: 0
    for step in range(1, 11):
        progress.update(record(step))  # the clock is read only when a line is printed: 2, 4, 6, 8
    progress.close()
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 3/10", "step 6/10", "step 9/10", "step 10/10"]
    # At step 3, 2 s over 3 steps leaves 7 steps: 4.67 s, printed as whole seconds.
    assert lines[0] == "step 3/10 | loss 4.3333 | lr 0.50 | 123,457 tok/s | mfu 41.2% | eta 0h00m04s"
    assert lines[3].endswith("eta 0h00m00s")
    assert "\r" not in out + err


def test_a_resumed_run_counts_from_its_first_step(capsys, monkeypatch):
    clock = iter([0, 3600])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    progress = Progress(total=100, initial=40, log_every=10, enabled=True, interactive=False)
    for step in range(41, 51):
        progress.update(record(step))
    # One hour for 10 steps leaves 50 steps: five hours.
    assert capsys.readouterr().out.splitlines() == [
        "step 50/100 | loss 4.0200 | lr 0.50 | 123,457 tok/s | mfu 41.2% | eta 5h00m00s"
    ]


def test_other_ranks_print_nothing(capsys):
    for interactive in (False, True):
        progress = Progress(total=5, initial=0, log_every=1, enabled=False, interactive=interactive)
        for step in range(1, 6):
            progress.update(record(step))
        progress.write("step 5: val loss 1.0")
        progress.close()
    assert capsys.readouterr() == ("", "")


def test_on_a_terminal_a_bar_with_the_messages_above_it(capsys):
    progress = Progress(total=5, initial=0, log_every=1, enabled=True, interactive=True)
    for step in range(1, 6):
        progress.update(record(step))
    progress.write("step 5: val loss 1.0")
    progress.close()
    out, err = capsys.readouterr()
    assert "step 5: val loss 1.0" in out
    assert "5/5" in err and "\r" in err  # tqdm redraws its line on stderr
