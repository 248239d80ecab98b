"""The Trainer in 2 and 3 CPU ranks: epochs over Data (batch= indices) and over scattered data
(batch_s) equal single-process training on the same batches; validation over the whole set with
num_slices; checkpoints restore parameters and optimizer state in every rank, by name; a resumed
run equals an uninterrupted one bit for bit and keeps the best checkpoint; early stopping;
schedules reach every rank; callbacks, CSV and TensorBoard logs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST, TIMEOUT, NumpyRule, Reference, initial_params, loss_graph, make_data, shared_params

import synk_lasagne.callbacks
import synk_lasagne.trainer
import synkhronos as synk
from synk_lasagne import (
    Callback,
    CSVLogger,
    Schedule,
    TensorBoardLogger,
    Trainer,
    load_checkpoint,
    make_eval_function,
    make_train_function,
    save_checkpoint,
    set_in_every_rank,
    updates,
)

pytestmark = pytest.mark.timeout(TIMEOUT)

N_ROWS = 45
RTOL, ATOL = 1e-9, 1e-12


@pytest.fixture(scope="module")
def data(ranks):
    x, y = make_data(N_ROWS, seed=11)
    return x, y, synk.data(x), synk.data(y)


@pytest.fixture(scope="module")
def reference():
    return Reference()


def model():
    x, y = pt.matrix("x"), pt.ivector("y")
    params = shared_params(initial_params())
    loss = loss_graph(x, y, params)
    logits = pt.tanh(x @ params[0] + params[1]) @ params[2] + params[3]
    accuracy = pt.mean(pt.eq(pt.argmax(logits, axis=1), y))
    return x, y, params, loss, accuracy


def assert_every_rank(variables, expected, ranks, what):
    gathered = synk.gather(variables, nd_up=1)
    for var, g, e in zip(variables, gathered, expected):
        for r in range(ranks):
            np.testing.assert_allclose(g[r], e, rtol=RTOL, atol=ATOL, err_msg=f"{what}: {var.name} in rank {r}")


def quiet(train, **kwargs):
    return Trainer(train, progress=False, verbose=False, **kwargs)


def test_fit_over_host_data_matches_single_process(ranks, data, reference):
    x, y, x_data, y_data = data
    xs, ys, params, loss, _ = model()
    train = make_train_function(loss, params, [xs, ys], updates.momentum, learning_rate=0.1, function_kwargs=FAST)
    trainer = quiet(train, batch_size=8, seed=7)
    history = trainer.fit((x_data, y_data), epochs=2)

    rng = np.random.default_rng(7)  # the Trainer's order of the rows
    ref, rule = initial_params(), NumpyRule("momentum", learning_rate=0.1)
    losses = []
    for _ in range(2):
        order = rng.permutation(N_ROWS)
        weighted = 0.0
        for start in range(0, N_ROWS, 8):  # 5 batches of 8, then one of 5 (kept: drop_last=False)
            idx = order[start:start + 8]
            value, grads = reference(x[idx], y[idx], ref)
            weighted += value * len(idx)
            ref = rule.step(ref, grads)
        losses.append(weighted / N_ROWS)
    assert_every_rank(params, ref, ranks, "after 2 epochs")
    assert [h["epoch"] for h in history] == [1, 2]
    assert trainer.epoch_size((x_data, y_data)) == (6, N_ROWS, N_ROWS)  # the steps of the reference above
    assert all(h["samples"] == N_ROWS and h["samples_per_s"] > 0 for h in history)
    np.testing.assert_allclose([h["train_loss"] for h in history], losses, rtol=1e-9)
    assert trainer.fit((x_data, y_data), epochs=1)[0]["epoch"] == 3  # epochs keep counting


def test_submitted_steps_equal_synchronous_steps_bit_for_bit(ranks, data, monkeypatch):
    """The Trainer submits its steps (reading each loss up to the window's depth later) and
    ``TrainFunction.submit`` returns futures: the same losses and parameters, bit for bit, as the
    same steps called one by one."""
    _, _, x_data, y_data = data
    spans = [(a, min(a + 8, N_ROWS)) for a in range(0, N_ROWS, 8)]
    made = []

    def build():
        xs, ys, params, loss, accuracy = model()
        train = make_train_function(loss, params, [xs, ys], updates.adam, learning_rate=0.01,
                                    outputs={"accuracy": accuracy}, function_kwargs=FAST)
        made.append(train)
        return params, train

    params, train = build()
    sync = [train(x_data, y_data, batch=slice(a, b)) for _ in range(2) for a, b in spans]
    sync_params = [synk.gather(p, nd_up=1) for p in params]

    submitted = []
    real_submit = synk.Function.submit
    monkeypatch.setattr(synk.Function, "submit", lambda f, *a, **k: submitted.append(1) or real_submit(f, *a, **k))
    params, train = build()
    futures = [train.submit(x_data, y_data, batch=slice(a, b)) for a, b in spans]
    assert [[float(v) for v in f.result()] for f in futures] == [[float(v) for v in s] for s in sync[:len(spans)]]
    assert len(submitted) == len(spans) - 1  # the first step runs synchronously (it compiles)

    class Losses(Callback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, trainer, step, outputs):
            self.seen.append((step, outputs["loss"], outputs["accuracy"]))

    params, train = build()
    losses = Losses()
    before = len(submitted)
    quiet(train, batch_size=8, shuffle=False, callbacks=[losses]).fit((x_data, y_data), epochs=2)
    assert len(submitted) - before == 2 * len(spans) - 2  # all but the first step of each size (8, 5 rows)
    assert [s for s, _, _ in losses.seen] == list(range(1, 2 * len(spans) + 1))
    assert [(v, a) for _, v, a in losses.seen] == [(float(v), float(a)) for v, a in sync]
    for p, expected in zip(params, sync_params):
        assert all(np.array_equal(g, e) for g, e in zip(synk.gather(p, nd_up=1), expected)), p.name


def test_drop_last_skips_the_last_smaller_batch_and_matches_single_process(ranks, data, reference):
    x, y, x_data, y_data = data
    xs, ys, params, loss, _ = model()
    train = make_train_function(loss, params, [xs, ys], updates.sgd, learning_rate=0.1, function_kwargs=FAST)
    trainer = quiet(train, batch_size=8, seed=5, drop_last=True)
    history = trainer.fit((x_data, y_data), epochs=2)

    rng = np.random.default_rng(5)
    ref, rule = initial_params(), NumpyRule("sgd", learning_rate=0.1)
    for _ in range(2):
        order = rng.permutation(N_ROWS)
        for start in range(0, 40, 8):  # 5 batches of 8; the last 5 rows dropped
            _, grads = reference(x[order[start:start + 8]], y[order[start:start + 8]], ref)
            ref = rule.step(ref, grads)
    assert_every_rank(params, ref, ranks, "drop_last, 2 epochs")
    assert [h["samples"] for h in history] == [40, 40]
    assert trainer.epoch_size((x_data, y_data)) == (5, 40, N_ROWS)


def test_an_epoch_without_a_batch_is_an_error_that_says_why(ranks, data):
    _, _, x_data, y_data = data
    xs, ys, params, loss, _ = model()
    train = make_train_function(loss, params, [xs, ys], updates.sgd, learning_rate=0.1, function_kwargs=FAST)
    before = [v.get_value() for v in params]
    with pytest.raises(ValueError, match=r"batch_size=64 .* 45 rows .* drop_last"):
        quiet(train, batch_size=64, drop_last=True).fit((x_data, y_data), epochs=1)
    for var, value in zip(params, before):
        np.testing.assert_array_equal(var.get_value(), value)
    assert quiet(train, batch_size=64).fit((x_data, y_data), epochs=1)[0]["samples"] == N_ROWS  # still usable


def test_fit_over_scattered_data_matches_single_process(ranks, reference):
    x, y = make_data(29, seed=13)
    x_s = pytensor.shared(np.zeros((0, x.shape[1])), name="x_s")
    y_s = pytensor.shared(np.zeros(0, dtype="int32"), name="y_s")
    params = shared_params(initial_params())
    train = make_train_function(loss_graph(x_s, y_s, params), params, [], updates.adam, learning_rate=0.01,
                                sliceable_shareds=[x_s, y_s], function_kwargs=FAST)
    synk.scatter([x_s, y_s], [x, y])
    trainer = quiet(train, batch_size=7, seed=3)
    history = trainer.fit((), epochs=2)

    rng = np.random.default_rng(3)
    local = np.array_split(np.arange(len(x)), ranks)
    shares = [7 // ranks + (r < 7 % ranks) for r in range(ranks)]
    ref, rule = initial_params(), NumpyRule("adam", learning_rate=0.01)
    for _ in range(2):
        orders = [rng.permutation(len(part)) for part in local]
        steps = max(math.ceil(len(part) / b) for part, b in zip(local, shares))
        for k in range(steps):
            union = np.concatenate([part[o[k * b:(k + 1) * b]] for part, o, b in zip(local, orders, shares)])
            _, grads = reference(x[union], y[union], ref)
            ref = rule.step(ref, grads)
    assert_every_rank(params, ref, ranks, "scattered data, 2 epochs")
    assert [h["samples"] for h in history] == [len(x), len(x)]
    assert trainer.epoch_size() == (steps, len(x), len(x))

    dropping = quiet(train, batch_size=7, seed=3, drop_last=True)  # each rank's whole shares only
    whole = min(len(part) // b for part, b in zip(local, shares))
    assert dropping.epoch_size() == (whole, whole * 7, len(x))
    assert dropping.fit((), epochs=1)[0]["samples"] == whole * 7


def test_validation_over_the_whole_set_with_slices(ranks, data):
    x, y, x_data, y_data = data
    xs, ys, params, loss, accuracy = model()
    evaluate = make_eval_function({"loss": loss, "accuracy": accuracy}, [xs, ys], function_kwargs=FAST)
    plain = pytensor.function([xs, ys], [loss, accuracy], **FAST)
    expected = dict(zip(["loss", "accuracy"], (float(v) for v in plain(x, y))))
    for slices in (1, 4):
        got = evaluate(x_data, y_data, num_slices=slices)
        assert list(got) == ["loss", "accuracy"]
        np.testing.assert_allclose([got["loss"], got["accuracy"]], [expected["loss"], expected["accuracy"]],
                                   rtol=1e-12)
    train = make_train_function(loss, params, [xs, ys], updates.sgd, learning_rate=0.1, function_kwargs=FAST)
    trainer = quiet(train, eval_fn=evaluate, batch_size=10, eval_slices=3)
    record = trainer.fit((x_data, y_data), epochs=1, valid=(x_data, y_data))[0]
    np.testing.assert_allclose(record["valid_loss"], float(plain(x, y)[0]), rtol=1e-12)
    assert {"valid_loss", "valid_accuracy", "valid_seconds"} <= set(record)


def test_checkpoint_restores_params_and_state_in_every_rank(ranks, data, tmp_path):
    _, _, x_data, y_data = data
    xs, ys, params, loss, _ = model()
    train = make_train_function(loss, params, [xs, ys], updates.adam, learning_rate=0.01, function_kwargs=FAST)
    batches = [np.arange(i, i + 9) for i in range(0, 36, 9)]
    for idx in batches[:2]:
        train(x_data, y_data, batch=idx)
    path = tmp_path / "ckpt.npz"
    trainer = quiet(train)
    trainer.save(path, note="after 2 steps")
    saved = [np.array(v) for v in synk.gather(train.variables, nd_up=1)]
    for idx in batches[2:]:
        train(x_data, y_data, batch=idx)
    continued = [np.array(v) for v in synk.gather(train.variables, nd_up=1)]
    synk.set_value(ranks - 1, params[0], np.full((5, 4), 9.0))  # one rank drifts: loading must fix it too

    meta = trainer.load(path)
    assert meta["note"] == "after 2 steps" and meta["names"][0] == "param/W1"
    now = synk.gather(train.variables, nd_up=1)
    for var, s, n in zip(train.variables, saved, now):
        np.testing.assert_array_equal(n, s, err_msg=f"{var.name} not restored in every rank")
    t_index = [v.name for v in train.variables].index("t")
    np.testing.assert_array_equal(now[t_index], np.full(ranks, 2.0))
    for idx in batches[2:]:  # training goes on exactly as it did from the saved point
        train(x_data, y_data, batch=idx)
    for var, c, n in zip(train.variables, continued, synk.gather(train.variables, nd_up=1)):
        np.testing.assert_allclose(n, c, rtol=1e-12, err_msg=var.name)


def test_checkpoint_matches_by_name_and_refuses_what_does_not_match(ranks, tmp_path):
    a = pytensor.shared(np.arange(3.0), name="a")
    b = pytensor.shared(np.ones((2, 2)), name="b")
    path = tmp_path / "ab.npz"
    save_checkpoint(path, [a, b], epoch=4)
    a.set_value(np.zeros(3))
    b.set_value(np.zeros((2, 2)))
    assert load_checkpoint(path, [b, a])["epoch"] == 4  # by name, in any order
    np.testing.assert_array_equal(a.get_value(), np.arange(3.0))
    np.testing.assert_array_equal(b.get_value(), np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"no values for \['c'\]"):
        load_checkpoint(path, [pytensor.shared(np.zeros(3), name="c")])
    with pytest.raises(ValueError, match="shape"):
        load_checkpoint(path, [pytensor.shared(np.zeros(4), name="a")])
    twins = [pytensor.shared(np.zeros(2), name="W"), pytensor.shared(np.zeros(2), name="W")]
    with pytest.raises(ValueError, match=r"\['W'\] are used by more than one variable.*name="):
        save_checkpoint(tmp_path / "w.npz", twins)
    with pytest.raises(ValueError, match="no name"):
        save_checkpoint(tmp_path / "w.npz", [pytensor.shared(np.zeros(2))])


def test_early_stopping_restores_the_best_epoch(ranks, data, tmp_path):
    _, _, x_data, y_data = data
    xs, ys, params, loss, _ = model()
    train = make_train_function(loss, params, [xs, ys], updates.sgd, learning_rate=0.2, function_kwargs=FAST)
    evaluate = make_eval_function({"loss": loss}, [xs, ys], function_kwargs=FAST)
    path = tmp_path / "best.npz"
    # the loss falls every epoch; monitoring it with mode="max" makes epoch 1 the best one
    trainer = quiet(train, eval_fn=evaluate, batch_size=9, monitor="valid_loss", mode="max", patience=2,
                    checkpoint=path)
    history = trainer.fit((x_data, y_data), epochs=10, valid=(x_data, y_data))
    assert [h["epoch"] for h in history] == [1, 2, 3] and trainer.stopped_early
    assert history[1]["valid_loss"] < history[0]["valid_loss"]
    assert trainer.best_epoch == 1
    with np.load(path) as f:  # the best epoch's state, beside it the last one's
        best = [f[f"param/{v.name}"] for v in train.params] + [f[f"optimizer/{v.name}"] for v in train.state]
    for var, b, now in zip(train.variables, best, synk.gather(train.variables, nd_up=1)):
        for r in range(ranks):
            np.testing.assert_array_equal(now[r], b, err_msg=f"{var.name} in rank {r}")
    np.testing.assert_allclose(evaluate(x_data, y_data)["loss"], history[0]["valid_loss"], rtol=1e-12)


def test_fit_in_several_calls_trains_on_and_restores_the_best_epoch_at_the_end(ranks, data):
    """Two calls of fit with restore_best=False, then restore_best_epoch: the same epochs, records
    and restored values as one call (epoch 1 made the best, as above)."""
    _, _, x_data, y_data = data
    runs = []
    for calls in ([4], [2, 2]):
        xs, ys, params, loss, _ = model()
        train = make_train_function(loss, params, [xs, ys], updates.adam, learning_rate=0.05, function_kwargs=FAST)
        evaluate = make_eval_function({"loss": loss}, [xs, ys], function_kwargs=FAST)
        trainer = quiet(train, eval_fn=evaluate, batch_size=9, seed=3, monitor="valid_loss", mode="max")
        if calls == [4]:
            trainer.fit((x_data, y_data), epochs=4, valid=(x_data, y_data))
        else:
            for epochs in calls:
                trainer.fit((x_data, y_data), epochs=epochs, valid=(x_data, y_data), restore_best=False)
            last = synk.gather(train.variables, nd_up=1)
            assert trainer.restore_best_epoch()  # epoch 1's values, not epoch 4's
            assert any(not np.array_equal(a, b) for a, b in zip(last, synk.gather(train.variables, nd_up=1)))
        runs.append((trainer, train))
    (one, one_fn), (two, two_fn) = runs
    assert [h["epoch"] for h in two.history] == [1, 2, 3, 4] and one.best_epoch == two.best_epoch == 1
    for key in ("train_loss", "valid_loss"):
        np.testing.assert_allclose([h[key] for h in two.history], [h[key] for h in one.history], rtol=RTOL)
    assert_every_rank(two_fn.variables, [np.asarray(v.get_value()) for v in one_fn.variables], ranks,
                      "restored after two calls")


def test_patience_needs_the_monitored_metric(ranks, data):
    _, _, x_data, y_data = data
    xs, ys, params, loss, _ = model()
    train = make_train_function(loss, params, [xs, ys], updates.sgd, learning_rate=0.1, function_kwargs=FAST)
    with pytest.raises(ValueError, match="valid_loss"):
        quiet(train, patience=1).fit((x_data, y_data), epochs=2)
    with pytest.raises(ValueError, match="no eval_fn"):
        quiet(train).fit((x_data, y_data), epochs=1, valid=(x_data, y_data))
    with pytest.raises(ValueError, match="batch_size"):
        quiet(train, batch_size=0)


def test_progress_bar_and_epoch_summary(ranks, data, capsys):
    _, _, x_data, y_data = data
    xs, ys, params, loss, accuracy = model()
    train = make_train_function(loss, params, [xs, ys], updates.sgd, learning_rate=0.1,
                                outputs={"accuracy": accuracy}, function_kwargs=FAST)
    record = Trainer(train, batch_size=15).fit((x_data, y_data), epochs=1)[0]
    captured = capsys.readouterr()
    assert "epoch 1, train_loss" in captured.out and "train_accuracy" in captured.out  # the summary line
    assert "samples/s" in captured.out
    assert "epoch 1" in captured.err and "sample" in captured.err  # tqdm's bar, on stderr
    assert 0 <= record["train_accuracy"] <= 1


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def on_epoch_begin(self, trainer, epoch):
        self.calls.append(("epoch", epoch))

    def on_step_end(self, trainer, step, outputs):
        self.calls.append(("step", step, sorted(outputs)))

    def on_epoch_end(self, trainer, record):
        self.calls.append(("end", record["epoch"]))


def scheduled_run(data, path):
    """A model trained with Adam and a learning rate that halves every epoch (a Schedule), epoch 1
    made the best (valid_loss watched with mode="max": the loss falls), checkpoints at ``path``."""
    xs, ys, params, loss, _ = model()
    lr = pytensor.shared(np.float64(0.05), name="learning_rate")
    train = make_train_function(loss, params, [xs, ys], updates.adam, learning_rate=lr, function_kwargs=FAST)
    evaluate = make_eval_function({"loss": loss}, [xs, ys], function_kwargs=FAST)
    recorder = Recorder()
    trainer = quiet(train, eval_fn=evaluate, batch_size=10, seed=3, monitor="valid_loss", mode="max",
                    checkpoint=path, callbacks=[Schedule(lr, lambda epoch: 0.05 * 0.5 ** (epoch - 1)), recorder,
                                                CSVLogger(path.parent / "log.csv")])
    return trainer, train, lr, recorder


def test_a_resumed_run_equals_an_uninterrupted_one_and_keeps_the_best_checkpoint(ranks, data, tmp_path):
    """4 epochs in one run, against 2 epochs, a new Trainer that loads the last checkpoint, and 2
    more: the same parameters and optimizer state in every rank (bit for bit), the same records,
    and the best checkpoint (epoch 1) is not replaced by the worse epochs 3 and 4."""
    _, _, x_data, y_data = data
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    whole, whole_fn, _, _ = scheduled_run(data, tmp_path / "one" / "best.npz")
    whole.fit((x_data, y_data), epochs=4, valid=(x_data, y_data), restore_best=False)

    first, _, _, _ = scheduled_run(data, tmp_path / "two" / "best.npz")
    first.fit((x_data, y_data), epochs=2, valid=(x_data, y_data))  # ends restoring epoch 1: the last file has epoch 2
    assert first.last_checkpoint == str(tmp_path / "two" / "best.last.npz")
    resumed, resumed_fn, lr, recorder = scheduled_run(data, tmp_path / "two" / "best.npz")
    meta = resumed.load(first.last_checkpoint)
    assert meta["epoch"] == 2 and resumed.best_epoch == 1 and resumed.step == 10
    resumed.fit((x_data, y_data), epochs=2, valid=(x_data, y_data), restore_best=False)

    for var, a, b in zip(whole_fn.variables, synk.gather(whole_fn.variables, nd_up=1),
                         synk.gather(resumed_fn.variables, nd_up=1)):
        for r in range(ranks):
            assert np.array_equal(a[r], b[r]), f"{var.name} in rank {r} differs from the uninterrupted run"
    timing = {"seconds", "samples_per_s", "valid_seconds", "warmup_seconds"}
    strip = [{k: v for k, v in h.items() if k not in timing} for h in resumed.history]
    assert strip == [{k: v for k, v in h.items() if k not in timing} for h in whole.history]
    assert [h["learning_rate"] for h in resumed.history] == [0.05, 0.025, 0.0125, 0.00625]
    np.testing.assert_array_equal(synk.gather(lr, nd_up=1), np.full(ranks, 0.00625))  # in every rank
    assert recorder.calls[0] == ("epoch", 3) and recorder.calls[1] == ("step", 11, ["loss"])
    assert recorder.calls[-1] == ("end", 4) and sum(c[0] == "step" for c in recorder.calls) == 10

    for directory in ("one", "two"):  # the best file: epoch 1's state, though epochs 2-4 came after
        with np.load(tmp_path / directory / "best.npz") as best, \
                np.load(tmp_path / directory / "best.last.npz") as last:
            best_meta, last_meta = json.loads(str(best["__meta__"])), json.loads(str(last["__meta__"]))
            assert (best_meta["epoch"], best_meta["best_epoch"], last_meta["epoch"]) == (1, 1, 4)
            np.testing.assert_array_equal(best["param/W1"], last["best/param/W1"])
    assert resumed.best_epoch == whole.best_epoch == 1
    assert resumed.restore_best_epoch()  # the best values came with the checkpoint
    with np.load(tmp_path / "two" / "best.npz") as best:
        np.testing.assert_array_equal(resumed_fn.params[0].get_value(), best["param/W1"])
    rows = (tmp_path / "two" / "log.csv").read_text().splitlines()
    assert rows[0].startswith("epoch,train_loss") and [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3", "4"]


def test_set_value_in_the_master_changes_one_rank_and_set_in_every_rank_all(ranks, data):
    _, _, x_data, y_data = data
    xs, ys, params, loss, _ = model()
    lr = pytensor.shared(np.float64(0.1), name="lr")
    train = make_train_function(loss, params, [xs, ys], updates.sgd, learning_rate=lr, function_kwargs=FAST)
    train(x_data, y_data, batch=np.arange(10))
    lr.set_value(np.float64(0.5))  # the master's copy only
    np.testing.assert_array_equal(synk.gather(lr, nd_up=1), [0.5] + [0.1] * (ranks - 1))
    set_in_every_rank(lr, 0.25)
    np.testing.assert_array_equal(synk.gather(lr, nd_up=1), np.full(ranks, 0.25))
    with pytest.raises(ValueError, match="shape"):
        set_in_every_rank(lr, [1.0, 2.0])
    steps = Schedule(lr, lambda step: 0.1 / step, per="step")
    trainer = quiet(train, batch_size=15, callbacks=[steps])
    record = trainer.fit((x_data, y_data), epochs=1)[0]
    assert trainer.step == 3 and record["lr"] == pytest.approx(0.1 / 3)
    np.testing.assert_array_equal(synk.gather(lr, nd_up=1), np.full(ranks, 0.1 / 3))
    gathered = synk.gather(params, nd_up=1)
    for var, g in zip(params, gathered):  # the ranks stayed together
        for r in range(1, ranks):
            assert np.array_equal(g[r], g[0]), f"{var.name} in rank {r}"


def test_trainer_save_refuses_parameters_of_the_same_name(ranks, data, tmp_path):
    xs, ys, params, loss, _ = model()
    for var in params:
        var.name = "W" if var.ndim == 2 else "b"  # Lasagne's unnamed layers: W, b, W, b
    train = make_train_function(loss, params, [xs, ys], updates.sgd, learning_rate=0.1, function_kwargs=FAST)
    with pytest.raises(ValueError, match=r"\['W', 'b'\] are used by more than one variable"):
        quiet(train).save(tmp_path / "x.npz")
    with pytest.raises(ValueError, match=r"save_checkpoint, not Trainer\.save"):
        save_checkpoint(tmp_path / "y.npz", [pytensor.shared(np.zeros(2), name="z")])
        quiet(train).load(tmp_path / "y.npz")


def test_steps_that_compile_are_timed_apart_and_durations_never_read_zero(ranks, data):
    _, _, x_data, y_data = data
    xs, ys, params, loss, _ = model()
    train = make_train_function(loss, params, [xs, ys], updates.sgd, learning_rate=0.1, function_kwargs=FAST)
    trainer = quiet(train, batch_size=10)  # 4 steps of 10 rows, 1 of 5: two sizes, each compiles once
    one, two = trainer.fit((x_data, y_data), epochs=2)
    assert 0 < one["warmup_seconds"] < one["seconds"] and "warmup_seconds" not in two
    assert one["samples_per_s"] == pytest.approx((45 - 15) / (one["seconds"] - one["warmup_seconds"]))
    assert synk_lasagne.trainer._duration(0.0004) == "0.4 ms"
    assert "0.00 s" not in synk_lasagne.trainer._summary({**two, "seconds": 0.001})


def test_tensorboard_logger_writes_scalars_or_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(synk_lasagne.callbacks, "_summary_writer", lambda: None)
    with pytest.raises(ImportError, match="pip install tensorboardX"):
        TensorBoardLogger(tmp_path)

    class Writer:
        def __init__(self, logdir):
            self.logdir, self.scalars = logdir, []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

        def flush(self):
            pass

    monkeypatch.setattr(synk_lasagne.callbacks, "_summary_writer", lambda: Writer)
    logger = TensorBoardLogger(tmp_path)
    logger.on_epoch_end(None, {"epoch": 3, "train_loss": 0.5, "samples": 10})
    assert logger.writer.logdir == str(tmp_path)
    assert logger.writer.scalars == [("train_loss", 0.5, 3), ("samples", 10.0, 3)]
