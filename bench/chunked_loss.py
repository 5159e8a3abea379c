"""The loss in chunks (trainkit/chunked_loss.py): a training step's peak memory with the whole logits and with the
loss a chunk of positions at a time, against the estimate (trainkit/estimate.py's activation_bytes).

    python bench/chunked_loss.py       # about 5 minutes on 2 CPU cores; run it alone on the machine

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
CASES = [0.0, 1024.0, 256.0]  # --loss_chunk_mib: whole, the default (1 GiB of logits), a quarter of it
START, END = "<!-- chunked loss: written by bench/chunked_loss.py -->", "<!-- end of chunked loss -->"

ONE = """
import json, sys, time, torch
sys.path.insert(0, {root!r})
import trainkit.strategies
from transformers import LlamaConfig, LlamaForCausalLM
from trainkit import chunked_loss
from trainkit.estimate import ModelShape, activation_bytes, decoder_shape, measured_activations
mib, vocab, hidden, layers, tokens = {case!r}
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                     tie_word_embeddings=False, attn_implementation="sdpa"))
chunked_loss.configure(model, mib)
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
estimate = activation_bytes(shape, 1, tokens, "no", False, model.loss_chunk_tokens)
print(json.dumps({{"chunk": model.loss_chunk_tokens, "estimate": estimate, "peak": peak, "seconds": seconds}}))
"""


def measure() -> str:
    mib = 1024 ** 2
    logits = 4 * VOCAB * (TOKENS - 1)
    rows = ["| --loss_chunk_mib | positions a chunk | estimate MiB | measured peak MiB | estimate / peak | "
            "peak saved against whole, MiB | step s |", "|---|---:|---:|---:|---:|---:|---:|"]
    whole = None
    for case in CASES:
        done = subprocess.run([sys.executable, "-c", ONE.format(root=str(ROOT), case=(case, VOCAB, HIDDEN, LAYERS,
                                                                                       TOKENS))],
                              capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        r = json.loads(done.stdout.strip().splitlines()[-1])
        whole = whole or r["peak"]
        rows.append(f"| {case:g}{' (whole)' if not case else ''} | {r['chunk'] or TOKENS - 1:,} | "
                    f"{r['estimate'] / mib:,.0f} | {r['peak'] / mib:,.0f} | {r['estimate'] / r['peak']:.3f} | "
                    f"{(whole - r['peak']) / mib:,.0f} | {r['seconds']:.1f} |")
        print(rows[-1], flush=True)
    load = os.getloadavg()
    return "\n".join([
        START, "## The loss in chunks: peak memory with and without the whole logits", "",
        f"`python bench/chunked_loss.py`: a Llama built from a config (vocabulary {VOCAB:,}, hidden {HIDDEN}, "
        f"{LAYERS} layers, sdpa), one sequence of {TOKENS:,} tokens, fp32, the causal-LM recipe's loss "
        "(trainkit/chunked_loss.py's next_token_losses), one step per case in a fresh process. The *measured peak* "
        "is the peak of live tensor bytes over the loss and its backward (torch.profiler's memory timeline, less "
        "what was live before); the estimate is what `--estimate` counts as activations. The whole logits of this "
        f"sequence take {logits / mib:,.0f} MiB in fp32, and the whole loss holds three tensors of that size at its "
        "peak (the logits, the softmax and the logits' gradient of its backward); a chunk holds its own three. "
        "The step time is one forward and backward without the profiler: the chunks' logits are computed twice "
        "(again in backward).",
        "", *rows, "",
        f"Load average when measured: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min), nothing else "
        "running. `tests/test_chunked_loss.py` holds the chunked loss and every gradient within 1e-6 of the whole "
        "one on eleven architectures, and the curves of chunked runs under DDP, ZeRO-2 offload, ZeRO-3 (+offload), "
        "FSDP2 (+offload) and TP within 1e-5 of one process's whole loss.",
        "", END])


if __name__ == "__main__":
    replace_section(measure(), START, END)
