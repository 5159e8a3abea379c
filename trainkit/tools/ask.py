"""Ask a fine-tuned model a question: the chat template it was trained with, a greedy answer to the end of its turn.

    python -m trainkit.tools.ask runs/chat/final "What is 7 times 6?"          # the merged model
    python -m trainkit.tools.ask runs/chat/final/adapter "What is 7 times 6?"  # the base + its LoRA adapters (peft)
    python -m trainkit.tools.ask runs/chat/final "What is 7 times 6?" --system "Answer in one line."

A folder with adapter_config.json loads through peft (the base model named there, or --base, the adapters over it);
any other through transformers. The tokenizer saved beside the weights carries the run's chat template
(--chat_template), so the question reads as the training conversations did; a tokenizer without one gets the question
as plain text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainkit.data import sft
from trainkit.data.sft import TURN_ENDS
from trainkit.launch.library_noise import silence_library_noise


class MissingBase(Exception):
    """An adapter whose base model cannot be loaded from where its adapter_config.json says."""


def answer(folder: Path, question: str, max_new_tokens: int = 64, system: str = "", base: str = "") -> str:
    """The model's greedy answer to one user turn (after a system turn, when `system` is given); an adapter folder
    over `base`, or over the base its adapter_config.json names."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel

        base = base or json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        try:
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(folder))
        except (OSError, ValueError) as e:  # a folder that is not there is taken for a Hub id, which it is not
            raise MissingBase(f"the base model of {folder} cannot be loaded from {base!r} ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    turns = [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True) \
        if tokenizer.chat_template else "\n\n".join(t["content"] for t in turns)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.eval().generate(ids, max_new_tokens=max_new_tokens, do_sample=False, tokenizer=tokenizer,
                                       stop_strings=TURN_ENDS, pad_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)
    return min((text.split(end)[0] for end in TURN_ENDS), key=len).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainkit.tools.ask", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a run's final/ (merged) or final/adapter/ (peft)")
    parser.add_argument("question")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--system", default=None, help="a system turn before the question; by default the one the "
                        f"training conversations opened with ({sft.CHAT_DEFAULTS} in the folder), if any; '' for none")
    parser.add_argument("--base", default="", help="an adapter's base model (a folder or Hub id), where its "
                        "adapter_config.json names one that is not found here")
    args = parser.parse_args(argv)
    silence_library_noise()
    if not (args.folder / "config.json").is_file() and not (args.folder / "adapter_config.json").is_file():
        print(f"error: {args.folder} holds no model (no config.json or adapter_config.json): pass a run's final/ or "
              f"final/adapter/", file=sys.stderr)
        return 2
    system = args.system
    if system is None and (args.folder / sft.CHAT_DEFAULTS).is_file():
        system = json.loads((args.folder / sft.CHAT_DEFAULTS).read_text())["system"]
        print(f"note: asking after the system turn the model was trained with ({args.folder / sft.CHAT_DEFAULTS}): "
              f"{system!r}; --system '' asks without it", file=sys.stderr)
    try:
        print(answer(args.folder, args.question, args.max_new_tokens, system or "", args.base))
    except MissingBase as e:
        print(f"error: {e}: pass the base model it was trained on with --base FOLDER_OR_HUB_ID", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
