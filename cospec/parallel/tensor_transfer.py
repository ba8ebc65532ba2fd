"""What a step sends between ranks, as tensors: the rollouts of a replica, and state dicts.

# R rollouts, L their tokens (prompts and responses) in all

A pickled-object collective (`broadcast_object_list`, `gather_object`, `send_object_list`) copies
through host memory, serialises on one thread, and on NCCL moves the bytes through a CUDA tensor
anyway; on the step's path it is a hidden sync and a copy per rank. Here the same data travel as a
handful of tensors whose sizes are sent first (a fixed-size header):
- `broadcast_rollouts`: a replica's rollouts (prompt and response ids, logprobs, advantages,
  rewards, finish reasons) from its generating rank to its other ranks: two broadcasts, the header
  [R, L] and then one int64 and one float64 tensor;
- `broadcast_draft_metrics`: the co-training's metrics from the last pipeline stage (one tensor);
- `StateDictSender` / `StateDictReceiver`: a module's state dict as one flat tensor per dtype,
  by point-to-point send and receive. The names, shapes and dtypes (the *manifest*) are exchanged
  once, as an object, when the pair is set up; every later transfer is tensors only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from cospec.parallel.launch import backend_device
from cospec.rollout.engine import Completion

_FINISH = {None: 0, "eos": 1, "length": 2}
_FINISH_NAMES = {v: k for k, v in _FINISH.items()}


def broadcast_rollouts(payload, *, src: int, group=None):
    """``payload`` = (completions, advantages [R], rewards [R], first) on rank ``src``, None
    elsewhere; returns it on every rank of ``group`` (completions rebuilt as `Completion`s)."""
    device = backend_device(group)
    header = torch.zeros(2, dtype=torch.long, device=device)
    if payload is not None:
        completions, advantages, rewards, first = payload
        ints = [[len(c.prompt), len(c.tokens), c.index, _FINISH[c.finish_reason]]
                for c in completions]
        ids = [t for c in completions for t in c.prompt + c.tokens]
        header = torch.tensor([len(completions), len(ids)], device=device)
    dist.broadcast(header, src, group=group)
    R, L = header.tolist()  # the transfer's one host read: the sizes
    if payload is not None:
        int_buf = torch.tensor([first] + [x for row in ints for x in row] + ids, dtype=torch.long,
                               device=device)
        logprobs = [lp for c in completions for lp in c.logprobs]
        float_buf = torch.cat([advantages.double().cpu(), rewards.double().cpu(),
                               torch.tensor(logprobs, dtype=torch.float64)]).to(device)
    else:
        int_buf = torch.empty(1 + 4 * R + L, dtype=torch.long, device=device)
        float_buf = torch.empty(2 * R + L, dtype=torch.float64, device=device)  # L >= responses
    float_buf = _fit(float_buf, 2 * R + L)
    dist.broadcast(int_buf, src, group=group)
    dist.broadcast(float_buf, src, group=group)
    if payload is not None:
        return payload
    ints_host, floats_host = int_buf.tolist(), float_buf.cpu()
    first, rows, flat = ints_host[0], ints_host[1:1 + 4 * R], ints_host[1 + 4 * R:]
    out, at, lp_at = [], 0, 2 * R
    for i in range(R):
        n_prompt, n_resp, index, finish = rows[4 * i:4 * i + 4]
        out.append(Completion(index=index, prompt=flat[at:at + n_prompt],
                              tokens=flat[at + n_prompt:at + n_prompt + n_resp],
                              logprobs=floats_host[lp_at:lp_at + n_resp].tolist(),
                              finish_reason=_FINISH_NAMES[finish]))
        at += n_prompt + n_resp
        lp_at += n_resp
    return out, floats_host[:R].float(), floats_host[R:2 * R].float(), first


def broadcast_draft_metrics(metrics: dict, *, src: int, ttt_steps: int, group=None) -> dict:
    """`cotrain_draft`'s metrics (``draft_loss``, ``draft_acceptance_tf`` per TTT step,
    ``draft_nonfinite_skipped``; or {} on a step without co-training) from rank ``src`` to every
    rank: one float64 tensor [present, loss, skipped, acceptance...] and one host read."""
    device = backend_device(group)
    buf = torch.zeros(3 + ttt_steps, dtype=torch.float64)
    if dist.get_rank() == src and metrics:
        acceptance = list(metrics["draft_acceptance_tf"])
        if len(acceptance) > ttt_steps:
            raise ValueError(f"{len(acceptance)} acceptance figures for {ttt_steps} TTT steps")
        buf[:3 + len(acceptance)] = torch.tensor(
            [1.0, metrics["draft_loss"], metrics["draft_nonfinite_skipped"], *acceptance],
            dtype=torch.float64)
    buf = buf.to(device)
    dist.broadcast(buf, src, group=group)
    present, loss, skipped, *acceptance = buf.tolist()
    if not present:
        return {}
    return {"draft_loss": loss, "draft_acceptance_tf": acceptance,
            "draft_nonfinite_skipped": int(skipped)}


def _fit(buf: Tensor, n: int) -> Tensor:
    """``buf`` padded with zeros to ``n`` entries (the logprobs are fewer than the L tokens)."""
    return buf if len(buf) == n else torch.cat([buf, buf.new_zeros(n - len(buf))])


def _manifest(state: dict[str, Tensor]) -> list[tuple[str, tuple, str]]:
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()]


def _flat_by_dtype(state: dict[str, Tensor], device) -> list[Tensor]:
    """One flat tensor per dtype, dtypes sorted by name, tensors in the state's order."""
    by: dict[str, list[Tensor]] = {}
    for t in state.values():
        by.setdefault(str(t.dtype), []).append(t.detach().reshape(-1))
    return [torch.cat(by[k]).to(device) for k in sorted(by)]


class StateDictSender:
    """The sending side of a state dict transfer to rank ``dst``: ``send(state)`` each time."""

    def __init__(self, dst: int, group=None):
        self.dst, self.group, self.manifest_sent = dst, group, False

    def send(self, state: dict[str, Tensor]) -> None:
        if not self.manifest_sent:  # once: the names, shapes and dtypes
            dist.send_object_list([_manifest(state)], dst=self.dst, group=self.group)
            self.manifest_sent = True
        for flat in _flat_by_dtype(state, backend_device(self.group)):
            dist.send(flat, self.dst, group=self.group)


class StateDictReceiver:
    """The receiving side: ``receive()`` returns the sender's state dict (on this rank's CPU or,
    under NCCL, its device)."""

    def __init__(self, src: int, group=None):
        self.src, self.group, self.manifest = src, group, None

    def receive(self) -> dict[str, Tensor]:
        if self.manifest is None:
            box = [None]
            dist.recv_object_list(box, src=self.src, group=self.group)
            self.manifest = box[0]
        device = backend_device(self.group)
        by: dict[str, list[tuple[str, tuple]]] = {}
        for name, shape, dtype in self.manifest:
            by.setdefault(f"torch.{dtype}", []).append((name, shape))
        state = {}
        for key in sorted(by):
            entries = by[key]
            sizes = [int(torch.Size(shape).numel()) for _, shape in entries]
            flat = torch.empty(sum(sizes), dtype=getattr(torch, key.removeprefix("torch.")),
                               device=device)
            dist.recv(flat, self.src, group=self.group)
            for (name, shape), part in zip(entries, flat.split(sizes)):
                state[name] = part.view(shape)
        return {name: state[name] for name, _, _ in self.manifest}
