"""Specification of cospec.parallel.tensor_transfer: what crosses ranks as tensors arrives equal to
what was sent (the oracle: the sender's own objects), with no pickled object after the first
transfer of a state dict."""

import pytest
import torch
import torch.distributed as dist

from cospec.parallel.launch import spawn
from cospec.parallel.tensor_transfer import (StateDictReceiver, StateDictSender,
                                             broadcast_draft_metrics, broadcast_rollouts)
from cospec.rollout.engine import Completion

ROLLOUTS = ([Completion(index=0, prompt=[1, 5, 6], tokens=[7, 8, 2], logprobs=[-0.5, -1.25, -0.125],
                        finish_reason="eos"),
             Completion(index=1, prompt=[1], tokens=[9] * 5, logprobs=[-2.0] * 5,
                        finish_reason="length"),
             Completion(index=2, prompt=[1, 4], tokens=[], logprobs=[], finish_reason="length")],
            torch.tensor([0.5, -1.0, 0.25]), torch.tensor([1.0, 0.0, 0.5]), 12)


METRICS = {"draft_loss": 2.5, "draft_acceptance_tf": [0.75, 0.5, 0.25], "draft_nonfinite_skipped": 1}


def _rank(rank, world):
    out = broadcast_rollouts(ROLLOUTS if rank == 0 else None, src=0)
    metrics = [broadcast_draft_metrics(METRICS if rank == 1 else {}, src=1, ttt_steps=3),
               broadcast_draft_metrics({}, src=1, ttt_steps=3)]  # a step without co-training
    state = {"w": torch.arange(6.0).view(2, 3), "b": torch.tensor([1.5], dtype=torch.float64),
             "ids": torch.tensor([3, 1, 4], dtype=torch.long), "h": torch.ones(2, dtype=torch.bfloat16)}
    received = []
    calls = {"object": 0}
    real_send_obj, real_recv_obj = dist.send_object_list, dist.recv_object_list

    def counted(fn):
        def wrapper(*args, **kwargs):
            calls["object"] += 1
            return fn(*args, **kwargs)
        return wrapper

    dist.send_object_list, dist.recv_object_list = counted(real_send_obj), counted(real_recv_obj)
    try:
        if rank == 0:
            sender = StateDictSender(dst=1)
            for k in range(3):
                sender.send({n: t * (k + 1) if t.is_floating_point() else t for n, t in state.items()})
        else:
            receiver = StateDictReceiver(src=0)
            received = [receiver.receive() for _ in range(3)]
    finally:
        dist.send_object_list, dist.recv_object_list = real_send_obj, real_recv_obj
    return out, received, calls["object"], state, metrics


@pytest.mark.slow
def test_rollouts_and_state_dicts_arrive_as_sent():
    (out0, _, calls0, state, metrics0), (out1, received, calls1, _, metrics1) = spawn(_rank, 2)
    assert metrics0 == metrics1 == [METRICS, {}]
    for out in (out0, out1):
        completions, advantages, rewards, first = out
        assert [vars(c) for c in completions] == [vars(c) for c in ROLLOUTS[0]]
        torch.testing.assert_close(advantages, ROLLOUTS[1])
        torch.testing.assert_close(rewards, ROLLOUTS[2])
        assert first == 12
    for k, got in enumerate(received):
        assert list(got) == list(state)  # names in the sender's order
        for name, t in state.items():
            want = t * (k + 1) if t.is_floating_point() else t
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    assert calls0 == calls1 == 1  # the manifest, once; the three transfers are tensors only
