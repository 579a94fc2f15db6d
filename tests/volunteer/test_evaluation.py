"""``volunteer join --evaluate`` in this process (issue 12 item 7, volunteer.evaluation): two evaluators of
the same step's parameters report the same held-out loss, which is the task's mean loss over the held-out
samples; evaluating never changes the training state; only due steps are evaluated, exactly at that step;
the record is signed by the peer; a held-out set too small for the run is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from protocols.evaluation import EvaluationReceipt, SignedEvaluation, decode_evaluation, evaluation_payload
from protocols.training import DatasetSpec, TrainingSpec
from shared.auth.keys import Identity, verify_by_peer_id
from shared.data.heldout import heldout_digest, read_heldout, write_heldout
from shared.errors import ConfigError
from volunteer.collab.trainer import LocalTrainer
from volunteer.evaluation import Evaluator, HeldoutSet, heldout_files, load_heldout
from volunteer.tasks import make_task

SPEC = TrainingSpec(
    task_options={"d_model": 16, "layers": 1, "heads": 2, "ffn": 32, "seq_len": 24},
    local_batch=8,
    dataset=DatasetSpec(source="files", files=["unused.jsonl"], eval_examples=40, eval_files=["held/*"]),
)


async def heldout(directory: Path) -> HeldoutSet:
    path = write_heldout(directory, 40, 7)
    return await load_heldout(make_task(SPEC), SPEC, [path])


def evaluator(every: int = 5, publish: object = None) -> Evaluator:
    task = make_task(SPEC)
    return Evaluator(task, LocalTrainer(task, SPEC, "run"), "run", Identity.generate(), every, publish)  # type: ignore[arg-type]


async def test_two_evaluators_of_the_same_parameters_report_the_same_loss_over_the_held_out_samples(
    tmp_path: Path,
) -> None:
    held = await heldout(tmp_path)
    assert held.examples == 40 and len(held.batches) == 5  # 40 samples in micro-batches of 8
    one, two = evaluator(), evaluator()
    for e in (one, two):
        e.trainer.step = 5
    first, second = await one.evaluate(5, held), await two.evaluate(5, held)
    assert first is not None and second is not None
    assert (first.loss, first.params, first.eval_set) == (second.loss, second.params, second.eval_set)
    assert first.params == one.trainer.fingerprint()
    # the mean over the held-out samples of the task's loss, the whole set as one batch
    task = make_task(SPEC)
    model = task.build_model().eval()
    samples = list(task.preprocess(iter(read_heldout([tmp_path / "heldout-00000.jsonl"], 40))))
    with torch.no_grad():
        whole = float(task.loss(model, task.collate(samples)))
    assert first.loss == pytest.approx(whole, rel=1e-5)
    assert first.eval_set == heldout_digest(read_heldout([tmp_path / "heldout-00000.jsonl"], 40))


async def test_evaluating_leaves_the_training_state_as_it_was(tmp_path: Path) -> None:
    held = await heldout(tmp_path)
    e = evaluator()
    batch = e.task.collate(list(read_heldout([tmp_path / "heldout-00000.jsonl"], 8)))
    e.trainer.accumulate(batch)  # gradients accumulated toward the next step
    grads = [p.grad.clone() for p in e.trainer.params if p.grad is not None]
    before = (e.trainer.fingerprint(), e.trainer.samples)
    e.trainer.step = 5
    assert await e.evaluate(5, held) is not None
    e.trainer.step = 0
    assert (e.trainer.fingerprint(), e.trainer.samples) == before
    after = [p.grad for p in e.trainer.params if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(grads, after, strict=True)) and len(after) == len(grads)
    assert e._model is not None and not e._model.training


async def test_only_due_steps_are_evaluated_and_only_at_that_step(tmp_path: Path) -> None:
    held = await heldout(tmp_path)
    e = evaluator(every=5)
    e.trainer.step = 6  # the parameters moved past step 5 before the evaluation began
    assert await e.evaluate(5, held) is None and e.skipped == 1
    e.step_done(4)  # not due
    e.step_done(5)
    e.step_done(10)  # due while step 5 waits: skipped, the evaluation does not queue up
    assert e.skipped == 2
    assert e._due[1].receive_nowait() == 5
    with pytest.raises(trio.WouldBlock):
        e._due[1].receive_nowait()


async def test_the_published_evaluation_is_signed_by_the_peer(tmp_path: Path) -> None:
    held = await heldout(tmp_path)
    sent: list[SignedEvaluation] = []

    async def publish(signed: SignedEvaluation) -> EvaluationReceipt:
        sent.append(signed)
        return EvaluationReceipt(step=5, loss=1.0, users=1, agrees=True)

    e = evaluator(publish=publish)
    e.trainer.step = 5
    result = await e.evaluate(5, held)
    [signed] = sent
    assert decode_evaluation(signed.evaluation) == result
    assert verify_by_peer_id(e.identity.peer_id, signed.signature, evaluation_payload(signed.evaluation))


async def test_held_out_files_are_the_local_eval_files_and_must_hold_the_runs_examples(
    tmp_path: Path,
) -> None:
    held = tmp_path / "held"
    (held / "b.txt").parent.mkdir()
    (held / "b.txt").write_text("second file\n")
    (held / "a.txt").write_text("one\n\ntwo\n")
    spec = TrainingSpec(dataset=DatasetSpec(source="files", files=["x"], eval_files=[str(held / "*.txt")]))
    files = await heldout_files(spec.dataset, None, tmp_path / "cache")
    assert files == [held / "a.txt", held / "b.txt"]
    assert read_heldout(files, 10) == [{"text": "one"}, {"text": "two"}, {"text": "second file"}]
    with pytest.raises(ConfigError, match="hold 3 examples; the run evaluates 256"):
        await load_heldout(make_task(spec), spec, files)
    with pytest.raises(ConfigError, match="served by its backbones"):
        await heldout_files(DatasetSpec(), None, tmp_path / "cache")


async def test_a_failing_evaluation_is_counted_and_does_not_end_the_volunteer(tmp_path: Path) -> None:
    held = await heldout(tmp_path)
    broken = dict(held.batches[0])
    broken["input_ids"] = torch.full_like(broken["input_ids"], 10**6)  # no such token: the model refuses
    e = evaluator(every=1)

    async def load() -> HeldoutSet:
        return HeldoutSet([broken], held.examples, held.digest)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(e.run, load)
        e.trainer.step = 1
        e.step_done(1)
        while not e.failures.total:
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert e.failures.snapshot() == {"held-out evaluation": 1}
