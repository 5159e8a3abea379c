"""Knowledge distillation's objective (recipes/distill.py): how far a student's next-token distributions are from a
teacher's, at the positions it learns, a chunk of positions at a time.

The generalized Jensen-Shannon divergence as TRL defines it (trl.experimental.gkd's generalized_jsd_loss, and the beta
of trl's DistillationTrainer; Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", arXiv:2306.13649, Eq. 1), with p_s and p_t the student's and the teacher's
softmax(logits / temperature) at one position:
  beta 0: the forward KL, KL(p_t || p_s) = sum p_t (log p_t - log p_s), mode covering (torchtune's KD loss);
  beta 1: the reverse KL, KL(p_s || p_t), mode seeking (MiniLLM; TRL's DistillationTrainer's default);
  else:   beta KL(p_t || m) + (1 - beta) KL(p_s || m) with m = beta p_t + (1 - beta) p_s (beta 0.5: the JSD).
The mixture's form tends to 0, not to a KL, as beta nears 0 or 1: the two ends are cases of their own, as in TRL.

Both models' logits at every position are the step's largest tensors (2 x tokens x vocabulary, in fp32). Beyond one
chunk (trainkit/losses/chunked_loss.py's size) each model runs with a head that projects only its last position
(chunked_loss.head_and_hidden), and the positions go through both heads and the divergence a chunk at a time under
torch.utils.checkpoint: a chunk's logits are freed once its divergence is known and made again in backward.

Offline, the teacher is its top-K entries per position, computed once (teacher_topk: their log-probabilities, their
ids and the log of the rest's mass). Both distributions are then compared on K + 1 outcomes: the K tokens, and
"another token" (the student's mass off those K). With K the whole vocabulary the rest is empty and the divergence is
the full one; with fewer it is the divergence of the two distributions coarsened alike (the teacher's tail is one
outcome, its shape unknown).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.checkpoint import checkpoint

from trainkit.errors import Problem
from trainkit.losses import chunked_loss


def problems(beta: float, temperature: float) -> list[Problem]:
    found = []
    if not 0 <= beta <= 1:
        found.append(Problem(f"beta must be in [0, 1] (0 forward KL, 0.5 JSD, 1 reverse KL), got {beta}", "--beta",
                             "use --beta 1 (TRL's default, the reverse KL) or --beta 0 (the forward KL)"))
    if not temperature > 0:
        found.append(Problem(f"temperature must be > 0, got {temperature}", "--temperature", "use --temperature 1"))
    return found


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """[positions]: the divergence at each position (the module docstring) of logits [positions, vocabulary]
    already divided by the temperature; computed in fp32."""
    student = F.log_softmax(student_logits.float(), dim=-1)
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    # F.kl_div(input, target, log_target=True) is KL(target || input): sum exp(target) (target - input)
    if beta == 0:
        return F.kl_div(student, teacher, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(teacher, student, reduction="none", log_target=True).sum(-1)
    mixture = torch.logsumexp(torch.stack([student + math.log1p(-beta), teacher + math.log(beta)]), dim=0)
    return beta * F.kl_div(mixture, teacher, reduction="none", log_target=True).sum(-1) + \
        (1 - beta) * F.kl_div(mixture, student, reduction="none", log_target=True).sum(-1)


REST_FLOOR = -1e4  # the log of an empty rest (K the whole vocabulary): a mass of exactly 0 that kl_div keeps finite


class TopK(NamedTuple):
    """A teacher as its top-K entries per position (teacher_topk), at the positions of a batch or of a chunk."""

    logps: torch.Tensor  # [..., K]: log softmax(logits / temperature) of its K likeliest tokens, likeliest first
    ids: torch.Tensor  # [..., K]: those tokens
    rest: torch.Tensor  # [...]: the log of every other token's mass (REST_FLOOR where there is none)

    def at(self, where: Any) -> TopK:
        return TopK(*(t[where] for t in self))

    def flat(self) -> TopK:  # every position in row-major order
        return TopK(self.logps.flatten(0, -2), self.ids.flatten(0, -2), self.rest.reshape(-1))


def teacher_topk(logits: torch.Tensor, k: int, temperature: float) -> TopK:
    """The teacher's K likeliest tokens at each position of logits [..., vocabulary], and the rest's mass."""
    logps = F.log_softmax(logits.float() / temperature, dim=-1)
    top, ids = logps.topk(min(k, logps.shape[-1]), dim=-1)
    rest = torch.logsumexp(logps.scatter(-1, ids, -math.inf), dim=-1)
    return TopK(top, ids.int(), rest.clamp(min=REST_FLOOR))


def topk_jsd(student_logits: torch.Tensor, teacher: TopK, beta: float) -> torch.Tensor:
    """[positions]: generalized_jsd of the student (logits [positions, vocabulary] already divided by the
    temperature) and a teacher given as its top K, both as K + 1 outcomes: the teacher's K tokens and all others."""
    student = F.log_softmax(student_logits.float(), dim=-1)
    ids = teacher.ids.long()
    rest = torch.logsumexp(student.scatter(-1, ids, -math.inf), dim=-1).clamp(min=REST_FLOOR)
    mine = torch.cat([student.gather(-1, ids), rest[:, None]], dim=-1)
    theirs = torch.cat([teacher.logps.float(), teacher.rest.float()[:, None]], dim=-1)
    return generalized_jsd(mine, theirs, beta)


class Divergences(NamedTuple):
    """What learned_divergences finds at the learned positions, in row-major order."""

    divergence: torch.Tensor  # [learned positions]: the generalized JSD there
    cross_entropy: torch.Tensor  # [learned positions]: the student's loss of the data's next token there
    aux_loss: torch.Tensor | None  # the student's own auxiliary loss (a mixture of experts), else None
    router_logits: tuple[torch.Tensor, ...] | None


def learned_divergences(student: nn.Module, teacher: nn.Module | TopK, student_inputs: dict[str, Any],
                        teacher_inputs: dict[str, Any], learned: torch.Tensor, beta: float, temperature: float,
                        chunk: int, vocab: int) -> Divergences:
    """The divergence and the student's cross entropy at every learned position ([rows, tokens - 1] bool: the
    prediction of token t + 1 at t), the teacher without gradients: a model, or its top K at every position ([rows,
    tokens - 1, K], precomputed). Each model gets its own inputs (the mask of packed rows depends on its attention).
    `chunk`: the positions per chunk (0: the whole logits at once); `vocab`: the logits' entries compared (both
    models' first `vocab`: the tokenizer's, where one model pads its embeddings)."""
    targets = student_inputs["input_ids"][:, 1:]
    if not chunk or targets.numel() <= chunk:
        out = student(**student_inputs)
        if isinstance(teacher, TopK):
            teach, taught = None, teacher.at(learned)
        else:
            with torch.no_grad():
                teach, taught = nn.Identity(), teacher(**teacher_inputs).logits[:, :-1][learned]
        divergence, cross_entropy = _chunk(nn.Identity(), teach, out.logits[:, :-1][learned], taught, targets[learned],
                                           beta, temperature, vocab)
        return Divergences(divergence, cross_entropy, getattr(out, "aux_loss", None),
                           getattr(out, "router_logits", None))
    project, hidden, last, out = chunked_loss.head_and_hidden(student, student, student_inputs)
    if isinstance(teacher, TopK):
        teach, chunks = None, _chunks(teacher.flat(), chunk)
    else:
        with torch.no_grad():
            teach, taught, _, _ = chunked_loss.head_and_hidden(teacher, teacher, teacher_inputs)
        chunks = taught[:, :-1].reshape(-1, taught.shape[-1]).split(chunk)
    # Every position, learned or not, a chunk at a time: each chunk calls both heads, which under ZeRO-3 gathers
    # their weights (a collective), so every rank must make as many chunks (its micro-batch's shape, the same on
    # every rank), not as many as its learned positions need; the learned ones are kept after.
    rows = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    parts = [checkpoint(_chunk, project, teach, mine, theirs, wanted, beta, temperature, vocab, use_reentrant=False)
             if torch.is_grad_enabled() else _chunk(project, teach, mine, theirs, wanted, beta, temperature, vocab)
             for mine, theirs, wanted in zip(rows.split(chunk), chunks, targets.reshape(-1).split(chunk), strict=True)]
    kept = learned.reshape(-1)
    # + 0 x the model's own output: backward passes through it, where FSDP2 hooks its gradients' reduction
    divergence = torch.cat([d for d, _ in parts])[kept] + 0 * last.sum()
    return Divergences(divergence, torch.cat([c for _, c in parts])[kept], getattr(out, "aux_loss", None),
                       getattr(out, "router_logits", None))


def _chunks(table: TopK, size: int) -> list[TopK]:
    return [TopK(*parts) for parts in zip(*(t.split(size) for t in table), strict=True)]


def _chunk(project: Callable[[torch.Tensor], torch.Tensor], teach: Callable[[torch.Tensor], torch.Tensor] | None,
           rows: torch.Tensor, taught: torch.Tensor | TopK, targets: torch.Tensor, beta: float, temperature: float,
           vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`teach`: the teacher's head, of its hidden states `taught`; None where `taught` is its top K."""
    logits = project(rows).float()[:, :vocab]
    if teach is None:
        divergence = topk_jsd(logits / temperature, taught, beta)
    else:
        with torch.no_grad():
            teacher = teach(taught).float()[:, :vocab]
        divergence = generalized_jsd(logits / temperature, teacher / temperature, beta)
    return divergence, F.cross_entropy(logits, targets, reduction="none")
