"""Long sequences: a training step's peak memory with the whole logits and with the loss a chunk of positions at a
time (trainkit/losses/chunked_loss.py), the MLP in chunks (trainkit/models/tiled_mlp.py) and activation checkpointing,
against the estimate (trainkit/estimate.py's activation_bytes); and, by that estimate, the longest sequence each fits in
a budget.

    python bench/long_sequence.py       # about 15 minutes on 2 CPU cores; run it alone on the machine

A Llama built from a config whose logits dominate (vocabulary 32,000, hidden 256, 4 layers, sdpa attention), one
sequence of 16,384 tokens, fp32, the causal-LM recipe's loss. Each case runs in a fresh process: one step measured by
trainkit/estimate.py's measured_activations (the peak of live tensor bytes over the loss and its backward, less what
was live before), then one step timed without the profiler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sections import replace_section  # noqa: E402

VOCAB, HIDDEN, LAYERS, TOKENS = 32000, 256, 4, 16384
# (--loss_chunk_mib, --gradient_checkpointing, --tiled_mlp): the loss whole, in the default chunks (1 GiB of logits),
# in a quarter of them; then with the MLP in chunks, with checkpointing, and all three
CASES = [(0.0, False, False), (1024.0, False, False), (256.0, False, False), (256.0, False, True), (0.0, True, False),
         (256.0, True, False), (256.0, True, True)]
START, END = "<!-- long sequence: written by bench/long_sequence.py -->", "<!-- end of long sequence -->"

ONE = """
import json, sys, time, torch
sys.path.insert(0, {root!r})
import trainkit.strategies
from transformers import LlamaConfig, LlamaForCausalLM
from trainkit.losses import chunked_loss
from trainkit.models import tiled_mlp
from trainkit.estimate import ModelShape, activation_bytes, decoder_shape, measured_activations
mib, checkpointing, tiled, vocab, hidden, layers, tokens = {case!r}
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                     tie_word_embeddings=False, attn_implementation="sdpa"))
chunked_loss.configure(model, mib)
if checkpointing:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
if tiled:
    tiled_mlp.tile(model)
ids = torch.randint(0, vocab, (1, tokens))
def step():
    return chunked_loss.next_token_losses(model, input_ids=ids, use_cache=False)[0].mean()
saved, peak = measured_activations(model, step)
model.zero_grad()
started = time.perf_counter()
step().backward()
seconds = time.perf_counter() - started
names, params = zip(*model.named_parameters())
shape = ModelShape(tuple(p.numel() for p in params), hidden, layers, names, (), decoder_shape(model))
estimate = activation_bytes(shape, 1, tokens, "no", checkpointing, model.loss_chunk_tokens, tiled)
print(json.dumps({{"chunk": model.loss_chunk_tokens, "estimate": estimate, "peak": peak, "seconds": seconds}}))
"""


BUDGETS = (4, 16)  # GiB of activations per rank


def longest(sps: tuple[int, ...] = (1,)) -> list[str]:
    """By the estimate checked above: the longest sequence (a multiple of 1,024 tokens, one per micro-batch) whose
    activations fit each budget per rank, per case, in one process and with each sequence-parallel size in `sps`
    (the ranks of a group share the sequence: bench/sequence_parallel.py checks that estimate)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import trainkit.strategies  # noqa: F401  (trainkit.estimate imports the strategies' base first)
    from trainkit.estimate import ModelShape, activation_bytes, decoder_shape
    from trainkit.losses.chunked_loss import chunk_tokens

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                                             num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                                             tie_word_embeddings=False, attn_implementation="sdpa"))
    names, params = zip(*model.named_parameters(), strict=True)
    shape = ModelShape(tuple(p.numel() for p in params), HIDDEN, LAYERS, names, (), decoder_shape(model))
    columns = [(b, sp) for b in BUDGETS for sp in sps]
    rows = ["| --loss_chunk_mib | tiled MLP | checkpointing | " + " | ".join(
        f"longest in {b} GiB" + (f", sp {sp}" if sp > 1 else "") for b, sp in columns) + " |",
        "|---|---|---|" + "---:|" * len(columns)]
    for chunk_mib, checkpointing, tiled in CASES:
        fits = []
        for budget, sp in columns:
            tokens = 0
            while activation_bytes(shape, 1, (tokens + 1024) // sp, "no", checkpointing,
                                   chunk_tokens(chunk_mib, VOCAB), tiled) <= budget * 1024 ** 3:
                tokens += 1024
            fits.append(f"{tokens:,}")
        rows.append(f"| {chunk_mib:g}{' (whole)' if not chunk_mib else ''} | {'on' if tiled else 'off'} | "
                    f"{'on' if checkpointing else 'off'} | " + " | ".join(fits) + " |")
    return rows


def measure() -> str:
    mib = 1024 ** 2
    logits = 4 * VOCAB * (TOKENS - 1)
    rows = ["| --loss_chunk_mib | positions a chunk | tiled MLP | checkpointing | estimate MiB | measured peak MiB | "
            "estimate / peak | less than the first row's peak, MiB | step s |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    whole = None
    for chunk_mib, checkpointing, tiled in CASES:
        case = (chunk_mib, checkpointing, tiled, VOCAB, HIDDEN, LAYERS, TOKENS)
        done = subprocess.run([sys.executable, "-c", ONE.format(root=str(ROOT), case=case)], capture_output=True,
                              text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        r = json.loads(done.stdout.strip().splitlines()[-1])
        whole = whole or r["peak"]
        rows.append(f"| {chunk_mib:g}{' (whole)' if not chunk_mib else ''} | {r['chunk'] or TOKENS - 1:,} | "
                    f"{'on' if tiled else 'off'} | {'on' if checkpointing else 'off'} | {r['estimate'] / mib:,.0f} | "
                    f"{r['peak'] / mib:,.0f} | "
                    f"{r['estimate'] / r['peak']:.3f} | {(whole - r['peak']) / mib:,.0f} | {r['seconds']:.1f} |")
        print(rows[-1], flush=True)
    load = os.getloadavg()
    return "\n".join([
        START, "## Long sequences: the loss and the MLP in chunks, activation checkpointing", "",
        f"`python bench/long_sequence.py`: a Llama built from a config (vocabulary {VOCAB:,}, hidden {HIDDEN}, "
        f"{LAYERS} layers, sdpa), one sequence of {TOKENS:,} tokens, fp32, the causal-LM recipe's loss "
        "(trainkit/losses/chunked_loss.py's next_token_losses), one step per case in a fresh process. "
        "The *measured peak* is the peak of live tensor bytes over the loss and its backward (torch.profiler's memory "
        "timeline, less "
        "what was live before); the estimate is what `--estimate` counts as activations. The whole logits of this "
        f"sequence take {logits / mib:,.0f} MiB in fp32, and the whole loss holds three tensors of that size at its "
        "peak (the logits, the softmax and the logits' gradient of its backward); a chunk holds its own three. "
        "The tiled MLP computes each layer's MLP 256 positions (the hidden size) at a time, again in backward. "
        "The step time is one forward and backward without the profiler: the chunks' logits are computed twice "
        "(again in backward), and so is a tiled MLP. One run each: a step's time here varies by about 15% from run "
        "to run (the first row took 37.2 s in an earlier run), so only larger differences mean anything. With "
        "checkpointing the peak is the loss's backward (the held layer inputs and one chunk's logits), which comes "
        "before any layer is recomputed: the tiled MLP then lowers the layers' recomputation, not the peak.",
        "", *rows, "",
        "The longest sequence whose activations fit a budget per rank, by the same estimate (sdpa's memory grows "
        "linearly with the sequence; its time does not: the attention's work grows with its square):",
        "", *longest(), "",
        f"Load average when measured: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min), nothing else "
        "running. `tests/test_chunked_loss.py` holds the chunked loss and every gradient within 1e-6 of the whole "
        "one on eleven architectures, and the curves of chunked runs under DDP, ZeRO-2 offload, ZeRO-3 (+offload), "
        "FSDP2 (+offload) and TP within 1e-5 of one process's whole loss.",
        "", END])


if __name__ == "__main__":
    replace_section(measure(), START, END)
