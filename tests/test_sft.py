"""Instruction and chat data (trainkit/data/sft.py through recipes/causal_lm.py): every layout learns exactly its
answers, the dry run shows them, mistakes are named, and a chat fine-tune trains under DDP like one process.

The model is a Qwen2 built from a config, with a byte-level BPE tokenizer trained here on the conversations: it has
no chat template of its own, so the runs pass `--chat_template chatml`, and ChatML's markers are plain text to it.
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import EXAMPLES, PARITY_BOUND, architecture, assert_refused, conversation, entry, launch, max_rel_diff
from trainkit.data import sft
from trainkit.errors import ConfigError
from trainkit.recipes import load_recipe


@pytest.fixture(scope="module")
def tokenizer(chat):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(chat[0])


TURNS = "2 plus 3 is 5.<|im_end|>\nDoubled it is 10.<|im_end|>\n"  # conversation(0)'s answers, each turn's end too


@pytest.mark.parametrize("layout, record, learned", [
    # the prompt's last space merges with the answer's first character into one token: learned with the answer
    ("prompt_completion", {"prompt": "What is 2 plus 3? ", "completion": "5."}, " 5.<|endoftext|>"),
    ("messages", {"messages": conversation(0)}, TURNS),
    ("alpaca", {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5."}, "5.<|im_end|>\n"),
    ("alpaca", {"instruction": "Add 2 and 3.", "input": "", "output": "5."}, "5.<|im_end|>\n"),
    ("sharegpt", {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                     "value": m["content"]} for m in conversation(0)]}, TURNS),
])
def test_each_layout_learns_exactly_its_answers(tokenizer, layout, record, learned):
    """The tokens with a label decode to the answers (with the end of each turn, which the model must learn to
    say), every other token is masked; the ids are the whole text's, as if it were trained on whole."""
    text, spans = sft.render(record, layout, tokenizer, sft.CHATML)
    ids, labels = sft.encode(text, spans, tokenizer, 512, train_on_all=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != sft.IGNORE]) == learned
    assert labels[0] == sft.IGNORE and sft.learned_count(labels) == len(tokenizer(learned)["input_ids"])
    if layout == "alpaca":
        assert ("\n\n2 and 3" in text) == bool(record["input"])  # the input after a blank line, when there is one
    _, everything = sft.encode(text, spans, tokenizer, 512, train_on_all=True)
    assert everything == ids


def test_a_prompt_completion_file_is_checked_and_encoded(chat, check_only, tmp_path):
    """prompt/completion strings from a file pass the record check (which read them as chat turns before: a
    KeyError), and a record whose completion is not a string is named by file and line."""
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus 2?", "completion": f" {i + 2}."}) + "\n"
                            for i in range(20)))
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(chat[0]), "--tokenizer", "saved", "--data", str(data),
            "--seq_len", "32", "--dry_run"]
    run = check_only(tmp_path / "out", *args)
    assert run.returncode == 0 and "example 0 (prompt_completion, 3 of 10 tokens learned" in run.stderr, run.stderr
    assert "What is 0 plus 2?[[ 2.<|endoftext|>]]" in run.stderr
    data.write_text(data.read_text() + json.dumps({"prompt": "Hi", "completion": ["5"]}) + "\n")
    assert_refused(check_only(tmp_path / "out", *args), f"{data}:21 has a completion that is not a string")


def test_a_sharegpt_turn_from_an_unknown_speaker_is_named(tokenizer):
    record = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "Hello"}]}
    with pytest.raises(ConfigError, match=r"a record has a turn from bot, a role no chat template knows \(known: "
                                          r"human, user, gpt, assistant, system\)"):
        sft.render(record, "sharegpt", tokenizer, sft.CHATML)
    renamed, _ = sft.render(record, "sharegpt", tokenizer, sft.CHATML, {"bot": "assistant"})
    assert renamed.endswith("<|im_start|>assistant\nHello<|im_end|>\n")


def test_content_as_a_list_of_text_parts_reads_as_its_text(tokenizer):
    """OpenAI's and transformers' multimodal layout: text parts joined, the same text as a plain string."""
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in conversation(0)]
    assert sft.render({"messages": parts}, "messages", tokenizer, sft.CHATML) == \
        sft.render({"messages": conversation(0)}, "messages", tokenizer, sft.CHATML)


@pytest.mark.parametrize("mistake, said", [
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]},
     "has a turn from bot, a role no chat template knows (known: system, user, assistant, tool): without a mapping "
     "its turns would be rendered and never learned (--data {path}): pass --role_map with each of its roles named "
     "as one of system, user, assistant, tool (--role_map bot=assistant)"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]},
     "has a message with a part of type image_url, which a text model cannot read"),
    ({"conversation": conversation(1)},
     "has no field(s) messages of the messages layout (its fields: conversation)"),
])
def test_chat_data_mistakes_are_named_at_file_and_line_by_the_dry_run_and_the_run(check_only, chat, tmp_path, mistake,
                                                                                   said):
    """A role no template knows (rendered, never learned: a refusal that blamed --seq_len when all were such), a
    non-text content part and a record without its field, on line 3 of a chat file: the dry run names the file and
    line (every record of the first MiB), and so does the run's own read of the whole file (past the first MiB
    too); no TypeError from inside the recipe."""
    folder, data = chat
    path = tmp_path / "bad.jsonl"
    good = [json.dumps({"messages": conversation(i)}) for i in range(40)]
    path.write_text("\n".join([*good[:2], json.dumps(mistake), *good[2:]]) + "\n")
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--data", str(path),
            "--data_format", "messages", "--chat_template", "chatml"]
    assert_refused(check_only(tmp_path / "dry", *args, "--dry_run"), f"{path}:3 {said.format(path=path)}")
    recipe = load_recipe("causal_lm")
    late = tmp_path / "late.jsonl"  # past the first MiB that the dry run reads: the run's read names it
    filler = json.dumps({"messages": conversation(0, 200)})
    lines = (1 << 20) // len(filler) + 2
    late.write_text("\n".join([filler] * lines + [json.dumps(mistake)]) + "\n")
    cfg = recipe.Config(model_name_or_path=str(folder), tokenizer="saved", data=str(late), data_format="messages",
                        chat_template="chatml", seq_len=64)
    with pytest.raises(ConfigError) as refused:
        recipe.make_datasets(cfg, tmp_path)
    assert str(refused.value).startswith(f"{late}:{lines + 1} {said.split(' (--data')[0]}")


def test_the_role_map_fix_applied_as_printed_trains_the_renamed_turns(check_only, chat, tmp_path):
    folder, _ = chat
    path = tmp_path / "bots.jsonl"
    path.write_text("".join(json.dumps({"messages": [{**m, "role": {"assistant": "bot"}.get(m["role"], m["role"])}
                                                     for m in conversation(i)]}) + "\n" for i in range(40)))
    run = check_only(tmp_path / "dry", "--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer",
                     "saved", "--data", str(path), "--chat_template", "chatml", "--dry_run", "--role_map",
                     "bot=assistant")
    assert run.returncode == 0, run.stderr
    assert "(messages, 23 of 92 tokens learned" in run.stderr  # the bot's turns learned as the assistant's


def test_an_answer_cut_by_seq_len_keeps_what_fits(tokenizer):
    text, spans = sft.render({"messages": conversation(0)}, "messages", tokenizer, sft.CHATML)
    full_ids, full_labels = sft.encode(text, spans, tokenizer, 512, train_on_all=False)
    cut = full_labels.index(next(t for t in full_labels if t != sft.IGNORE)) + 3  # 3 tokens into the first answer
    ids, labels = sft.encode(text, spans, tokenizer, cut, train_on_all=False)
    assert ids == full_ids[:cut] and labels == full_labels[:cut] and sft.learned_count(labels) == 3


def test_the_dry_run_shows_the_first_example_with_the_learned_tokens_marked(check_only, chat, tmp_path):
    folder, data = chat
    run = check_only(tmp_path / "out", "--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer",
                     "saved", "--data", str(data), "--chat_template", "chatml", "--dry_run")
    assert run.returncode == 0, run.stderr
    assert "note: example 0 (messages, 23 of 92 tokens learned, between [[ and ]]):\n" in run.stderr
    assert ("<|im_start|>assistant\n[[2 plus 3 is 5.<|im_end|>\n]]<|im_start|>user\nAnd doubled?<|im_end|>\n"
            "<|im_start|>assistant\n[[Doubled it is 10.<|im_end|>\n]]") in run.stderr
    assert json.loads(run.stdout)["data_format"] == "auto"
    packed = check_only(tmp_path / "packed", "--recipe", "causal_lm", "--model_name_or_path", str(folder),
                        "--tokenizer", "saved", "--data", str(data), "--chat_template", "chatml", "--dry_run",
                        "--preview", "3", "--packing", "--seq_len", "192")
    assert packed.returncode == 0, packed.stderr
    assert "note: example 3 (messages, 23 of 92 tokens learned" in packed.stderr and "What is 5 plus 6?" in \
        packed.stderr
    assert "its packed row (--packing: examples 3, 4 of the 64 from 3 on, 184 of 192 positions used" in packed.stderr
    assert packed.stderr.count("What is 6 plus 7?") == 1  # example 4, in the row only
    assert_refused(check_only(tmp_path / "far", "--recipe", "causal_lm", "--model_name_or_path", str(folder),
                              "--tokenizer", "saved", "--data", str(data), "--chat_template", "chatml", "--dry_run",
                              "--preview", "500"),
                   f"--preview 500: {data} holds {EXAMPLES} examples (--preview): pass a number from 0 to "
                   f"{EXAMPLES - 1}")


def test_chat_data_mistakes_are_named_with_the_fix(check_only, chat, tmp_path):
    folder, data = chat
    base = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--dry_run"]
    assert_refused(check_only(tmp_path / "a", *base, "--data", str(data)),
                   "the tokenizer has no chat template to render messages data with (--chat_template): pass "
                   "--chat_template chatml")
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"question": "2+3?", "answer": "5"}) + "\n")
    assert_refused(check_only(tmp_path / "b", *base, "--data", str(odd)),  # no layout's fields: taken as text
                   f"{odd}:1 has no field 'text' (its fields: question, answer) (--data {odd}): name the text field "
                   "with --text_field")
    assert_refused(check_only(tmp_path / "c", *base, "--data", str(data), "--data_format", "chat"),
                   "unknown data_format 'chat' (config field data_format): use auto or one of text, "
                   "prompt_completion, messages, alpaca, sharegpt")
    assert_refused(check_only(tmp_path / "d", *base, "--data", str(data), "--chat_template", "vicuna"),
                   "no chat template 'vicuna' (--chat_template): pass chatml, or the path of a Jinja template file")


def test_data_with_nothing_left_to_learn_is_refused(chat, test_env, tmp_path):
    """seq_len 16 ends every conversation before its first answer: refused, not trained on nothing."""
    folder, data = chat
    recipe = load_recipe("causal_lm")
    cfg = recipe.Config(model_name_or_path=str(folder), tokenizer="saved", data=str(data), chat_template="chatml",
                        seq_len=16)
    with pytest.raises(ConfigError, match=rf"none of the {EXAMPLES} examples of {data} has a token to learn: "
                                          rf"{EXAMPLES} have no answer token within --seq_len 16: left out \(the "
                                          r"first: record 1\) .*: pass a larger --seq_len, or --train_on all"):
        recipe.make_datasets(cfg, tmp_path)
    cfg = recipe.Config(model_name_or_path=str(folder), tokenizer="saved", data=str(data), chat_template="chatml",
                        seq_len=60)  # the first answer fits, the second is cut: every example kept
    train, held_out = recipe.make_datasets(cfg, tmp_path)
    assert len(train) + len(held_out) == EXAMPLES and set(train[0]) == {"input_ids", "attention_mask", "labels"}


def test_a_json_file_holding_one_array_is_read_as_its_records(check_only, chat, tmp_path):
    """A .json file of one JSON array (as datasets reads it): its layout detected from the first element, checked
    record by record (element 3 named), the same examples as the JSON-lines file."""
    folder, data = chat
    records = [json.loads(line) for line in data.read_text().splitlines()]
    array = tmp_path / "chat.json"
    array.write_text(json.dumps(records, indent=1))
    base = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--chat_template",
            "chatml", "--dry_run"]
    lines, whole = (check_only(tmp_path / name, *base, "--data", str(path)) for name, path in (("a", data),
                                                                                            ("b", array)))
    assert whole.returncode == 0 and "example 0 (messages, " in whole.stderr, whole.stderr
    assert whole.stderr.split("example 0")[1] == lines.stderr.split("example 0")[1]
    records[2] = {"messages": [{"role": "robot", "content": "beep"}]}
    array.write_text(json.dumps(records))
    assert_refused(check_only(tmp_path / "c", *base, "--data", str(array)), f"{array}:3 has a turn from robot")


def test_answers_that_teach_nothing_are_counted_and_rows_without_one_refused_by_the_dry_run_and_the_run(
        check_only, chat, tmp_path):
    """Conversations without an assistant turn (a user's question alone) are left out, empty answers teach only the
    end of the turn, a turn after the last answer is never learned: each kind counted before the run trains, the
    same by the dry run; a file with no answer at all is refused naming that, not --seq_len. With the gaps left out,
    the kept examples encode as before (the same rows as a file without them)."""
    folder, data = chat
    good = [json.loads(line) for line in data.read_text().splitlines()][:6]
    question = {"messages": [{"role": "user", "content": "What is 2 plus 2?"}]}
    empty = {"messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]}
    after = {"messages": [*good[0]["messages"], {"role": "user", "content": "Thanks!"}]}
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in [good[0], question, empty, *good[1:], after, question]))
    base = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--chat_template",
            "chatml", "--seq_len", "255"]
    run = check_only(tmp_path / "a", *base, "--data", str(mixed), "--dry_run")
    assert run.returncode == 0, run.stderr
    assert (f"note: of the 10 examples of {mixed}, 2 have no assistant answer to learn (no assistant turn): left out "
            "(the first: record 2); 1 have only empty answers: the end of the turn is all they teach (the first: "
            "record 3); 1 end with a turn after the last answer: that turn is read, never learned (the first: record "
            "9)") in run.stderr
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps(question) + "\n" + json.dumps(question) + "\n")
    said = (f"none of the 2 examples of {questions} has a token to learn: 2 have no assistant answer to learn (no "
            f"assistant turn): left out (the first: record 1) (--data {questions}): give each conversation the "
            "assistant's answer to learn")
    assert_refused(check_only(tmp_path / "b", *base, "--data", str(questions), "--dry_run"), said)
    recipe = load_recipe("causal_lm")
    settings = {"model_name_or_path": str(folder), "tokenizer": "saved", "chat_template": "chatml", "seq_len": 255}
    with pytest.raises(ConfigError) as refused:  # the run's own data path (build_datasets)
        recipe.make_datasets(recipe.Config(data=str(questions), **settings), tmp_path)
    assert said.split(" (--data")[0] == refused.value.problems[0].what
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in [good[0], empty, *good[1:], after]))
    kept, alone = recipe.make_datasets(recipe.Config(data=str(mixed), eval_data=str(plain), **settings), tmp_path)
    assert len(kept) == 8 and [r["input_ids"].tolist() for r in kept] == [r["input_ids"].tolist() for r in alone]
    assert [r["labels"].tolist() for r in kept] == [r["labels"].tolist() for r in alone]


@pytest.mark.slow
@pytest.mark.parametrize("packing", [["--seq_len", "96"], ["--packing", "--seq_len", "192"],
                                     ["--packing", "--seq_len", "192", "--streaming", "true"]],
                         ids=["padded", "packed", "streamed_mixture_packed"])
def test_chat_fine_tuning_under_ddp_matches_one_process(chat, run_dir, packing):
    """The loss on the answers only, the same curve under DDP as in one process (padded, packed two examples to a
    row, and a streamed mixture of two chat files packed as it streams), and final/ loads as it was."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, data = chat
    streamed = "--streaming" in packing
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--data",
            f"{data}:1,{data.parent / 'uneven.jsonl'}:1" if streamed else str(data), "--chat_template", "chatml",
            "--max_steps", "8", "--eval_every", "0", "--lr", "3e-3", *packing]
    one = launch(run_dir("one"), *args, "--batch_size", "8").check()
    assert one.resolved["packing"] == ("--packing" in packing) and ("--data streamed" in one.stderr) == streamed
    ddp = launch(run_dir("ddp"), *args, "--batch_size", "4", config="ddp").check()
    assert max_rel_diff(ddp.losses, one.losses) < PARITY_BOUND and one.losses[-1] < one.losses[0]
    # every held-out row evaluated on both process counts (packed: 3 rows, which 2 x 4 cannot split evenly)
    assert abs(ddp.metrics[-1]["eval_loss"] - one.metrics[-1]["eval_loss"]) <= PARITY_BOUND * one.metrics[-1][
        "eval_loss"]
    assert AutoModelForCausalLM.from_pretrained(one.output_dir / "final").config.vocab_size == 400
    assert AutoTokenizer.from_pretrained(one.output_dir / "final")("2 plus 3").input_ids



UNEVEN = ["--tokenizer", "saved", "--chat_template", "chatml", "--seq_len", "192", "--max_steps", "4", "--eval_every",
          "0", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def uneven_reference(chat, tmp_path_factory):
    """One process, the whole global batch of 16 in one micro-batch, on examples that learn 16 to 97 tokens."""
    folder, data = chat
    return launch(tmp_path_factory.mktemp("uneven") / "ref", "--recipe", "causal_lm", "--model_name_or_path",
                  str(folder), "--data", str(data.parent / "uneven.jsonl"), *UNEVEN, "--batch_size", "16").check()


@pytest.mark.slow
@pytest.mark.parametrize("split", [
    ("single", "1 process x 2 micro-batches of 8", ["--batch_size", "8", "--grad_accum", "2"]),
    ("ddp", "2 processes x 2 micro-batches of 4", ["--batch_size", "4", "--grad_accum", "2"]),
    # one config per way a step is taken: DeepSpeed's engine (ZeRO-1/2 share its step, ZeRO-3 with its offload
    # stands for both), FSDP2 (its offload the same step), tensor parallelism (ranks that share a batch)
    *[(name, name, entry(name, 16)[1]) for name in ("deepspeed_zero2", "deepspeed_zero3_offload", "fsdp", "tp")],
], ids=lambda split: split[0])
def test_every_split_of_the_global_batch_gives_the_same_token_mean_loss(chat, uneven_reference, run_dir, split):
    """The loss of a step is the sum over every learned token of the global batch over their count: micro-batches
    whose learned tokens differ several-fold (answers 1 to 10 times as long) weigh by their tokens, so the loss and
    the gradient norm are the one-micro-batch run's to 1e-6 under every split and strategy. Averaging each
    micro-batch's mean instead (the recipe without loss_weight) misses by 6.7e-5 in the loss and 4.2e-3 in the
    gradient norm (measured at 1 process x 2 micro-batches of 8; weighed: 2.4e-7 and 8.2e-8)."""
    folder, data = chat
    config, _, flags = split
    run = launch(run_dir("out"), "--recipe", "causal_lm", "--model_name_or_path", str(folder), "--data",
                 str(data.parent / "uneven.jsonl"), *UNEVEN, *flags, config=None if config == "single" else config)
    run.check()
    assert max_rel_diff(run.losses, uneven_reference.losses) < 1e-6
    evaluated = [r["eval_loss"] for r in (run.metrics[-1], uneven_reference.metrics[-1])]
    assert abs(evaluated[0] - evaluated[1]) <= 1e-6 * evaluated[1]  # the same held-out tokens, weighed alike
    assert max_rel_diff([m["grad_norm"] for m in run.metrics],
                        [m["grad_norm"] for m in uneven_reference.metrics]) < 1e-6


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["qwen2", "llama", "gpt_neox"])
def test_packed_examples_see_only_themselves(chat, test_env, tmp_path, name, attention):
    """Every example of a packed row has the per-token losses it has alone, to 1e-6 (position_ids restarting per
    example are not enough under sdpa or eager: the block-diagonal mask isolates them), and packing keeps every
    learned token: the rows hold the same examples and learn as many tokens."""
    import torch

    folder, data = chat
    torch.manual_seed(0)
    architecture(name, attention).save_pretrained(tmp_path / name)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name / file).write_bytes((folder / file).read_bytes())
    recipe = load_recipe("causal_lm")
    token_losses = sys.modules["recipe_causal_lm"]._token_losses  # the recipe's own, as its loss calls it
    settings = {"model_name_or_path": str(tmp_path / name), "tokenizer": "saved", "data": str(data.parent /
                "uneven.jsonl"), "chat_template": "chatml", "seq_len": 384, "eval_fraction": 0.25}
    packed = recipe.make_datasets(recipe.Config(**settings, packing=True), tmp_path)
    alone = recipe.make_datasets(recipe.Config(**settings), tmp_path)
    examples = [row for split in alone for row in split]
    rows = [row for split in packed for row in split]
    assert len(rows) < len(examples) / 2  # short examples share rows
    learned = sum(int((r["labels"][1:] != sft.IGNORE).sum()) for r in examples)
    assert sum(int((r["labels"][1:] != sft.IGNORE).sum()) for r in rows) == learned
    model = recipe.build_model(recipe.Config(**settings)).eval()
    with torch.no_grad():
        for row in rows[:3]:
            losses, real, _, _ = token_losses(model, {k: v[None] for k, v in row.items()})
            for number in range(1, int(row["segment"].max()) + 1):
                where = (row["segment"] == number).nonzero().flatten()
                start, end = int(where[0]), int(where[-1]) + 1
                ids = row["input_ids"][start:end]
                match = next(e for e in examples if torch.equal(e["input_ids"][:end - start], ids)
                             and int(e["attention_mask"].sum()) == end - start)
                own, own_real, _, _ = token_losses(model, {k: v[None] for k, v in match.items()})
                n = end - start - 1  # predictions inside the example; its last one is the next example's
                assert torch.equal(real[0, start:start + n], own_real[0, :n])
                assert (losses[0, start:start + n] - own[0, :n]).abs().max() < 1e-6


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_samples_average_is_the_mean_of_each_examples_own_mean(chat, test_env, tmp_path, packing):
    """--loss_average samples, the other objective: a micro-batch's loss is the mean over its examples (rows, or a
    packed row's examples) of each one's mean over its learned tokens, and it weighs as many examples as it holds;
    the tokens average differs from it on these uneven examples."""
    import torch
    from torch.utils.data import default_collate

    folder, data = chat
    recipe, module = load_recipe("causal_lm"), sys.modules["recipe_causal_lm"]
    settings = {"model_name_or_path": str(folder), "tokenizer": "saved", "data": str(data.parent / "uneven.jsonl"),
                "chat_template": "chatml", "seq_len": 384, "packing": packing}
    samples = recipe.Config(**settings, loss_average="samples")
    batch = default_collate([recipe.make_datasets(samples, tmp_path)[0][i] for i in range(4)])
    torch.manual_seed(0)
    model = recipe.build_model(samples).eval()
    with torch.no_grad():
        token_loss, real, _, _ = module._token_losses(model, batch)
        owner = batch["segment"][:, 1:] if packing else torch.ones_like(real, dtype=torch.long)
        means = [token_loss[b][real[b] & (owner[b] == k)].mean() for b in range(len(real))
                 for k in owner[b][real[b]].unique()]
        expected = float(torch.stack(means).mean())
        assert abs(float(module.loss(model, batch)) - expected) < 1e-6 * expected  # relative: 1/n in float32
        assert module.loss_weight(samples, batch) == pytest.approx(len(means)) and len(means) > 4 * packing
        tokens = recipe.Config(**settings)
        plain = default_collate([recipe.make_datasets(tokens, tmp_path)[0][i] for i in range(4)])
        assert abs(float(module.loss(model, plain)) - float((token_loss * real).sum() / real.sum())) < 1e-6 * expected
        assert abs(float(module.loss(model, plain)) - float(module.loss(model, batch))) > 1e-4  # measured 7.5e-4 packed


@pytest.mark.slow
def test_the_samples_average_is_the_same_for_every_split(chat, run_dir):
    folder, data = chat
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--data", str(data.parent / "uneven.jsonl"),
            *UNEVEN, "--loss_average", "samples"]
    one = launch(run_dir("one"), *args, "--batch_size", "16").check()
    ddp = launch(run_dir("ddp"), *args, "--batch_size", "4", "--grad_accum", "2", config="ddp").check()
    assert max_rel_diff(ddp.losses, one.losses) < 1e-6
    assert max_rel_diff([m["grad_norm"] for m in ddp.metrics], [m["grad_norm"] for m in one.metrics]) < 1e-6


def _examples_of(rows) -> list[tuple[int, ...]]:
    """The examples in rows of the causal-LM recipe, padded (one each) or packed (split by segment), sorted."""
    found = []
    for row in rows:
        ids = row["input_ids"].tolist()
        if "segment" in row:
            segments = row["segment"].tolist()
            found += [tuple(t for t, s in zip(ids, segments, strict=True) if s == k) for k in set(segments) - {0}]
        else:
            found.append(tuple(ids[:int(row["attention_mask"].sum())]))
    return sorted(found)


def test_the_held_out_examples_are_drawn_from_the_seed_before_packing(chat, test_env, tmp_path):
    """eval_fraction of the examples, drawn from the seed: the same examples whether they are packed or padded
    (packing the whole set first and holding out its last rows held out the shortest examples), others for another
    seed; --eval_data holds out that file's examples instead, and every example of --data trains."""
    folder, data = chat
    recipe = load_recipe("causal_lm")
    common = {"model_name_or_path": str(folder), "tokenizer": "saved", "data": str(data), "chat_template": "chatml",
              "seq_len": 192}
    train, padded = recipe.make_datasets(recipe.Config(**common), tmp_path)
    _, packed = recipe.make_datasets(recipe.Config(**common, packing=True), tmp_path)
    assert len(padded) == int(EXAMPLES * 0.05) and len(train) == EXAMPLES - len(padded) and len(packed) < len(padded)
    assert _examples_of(packed) == _examples_of(padded)
    assert _examples_of(recipe.make_datasets(recipe.Config(**common, seed=1), tmp_path)[1]) != _examples_of(padded)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"messages": conversation(i, 2)}) + "\n" for i in range(5)))
    train, evaluated = recipe.make_datasets(recipe.Config(**common, eval_data=str(held), packing=True), tmp_path)
    _, alone = recipe.make_datasets(recipe.Config(**{**common, "data": str(held)}, eval_fraction=0.5), tmp_path)
    assert len(_examples_of(evaluated)) == 5 and sum(len(r["input_ids"]) for r in train) >= EXAMPLES * 60
    assert set(_examples_of(alone)) < set(_examples_of(evaluated))  # that file's own examples


@pytest.mark.slow
def test_an_eval_file_is_evaluated_whole_on_any_process_count(chat, run_dir, tmp_path):
    """--eval_data with 5 examples packed into rows that 2 processes x 2 cannot split evenly: one process and DDP
    give the same eval loss, every row evaluated (before, the rows past the last whole global batch were not)."""
    folder, data = chat
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"messages": conversation(i, i + 1)}) + "\n" for i in range(5)))
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--data",
            str(data), "--eval_data", str(held), "--chat_template", "chatml", "--seq_len", "96", "--max_steps", "2",
            "--eval_every", "0"]
    one = launch(run_dir("one"), *args, "--batch_size", "4").check()
    ddp = launch(run_dir("ddp"), *args, "--batch_size", "2", config="ddp").check()
    assert abs(ddp.metrics[-1]["eval_loss"] - one.metrics[-1]["eval_loss"]) <= PARITY_BOUND * one.metrics[-1][
        "eval_loss"]
    answers = [json.loads(line) for line in (one.output_dir / "generations.jsonl").read_text().splitlines()]
    assert [a["expected"] for a in answers] == ["2 plus 3 is 5.<|im_end|>\n",
                                                              "3 plus 4 is 7. 3 plus 4 is 7.<|im_end|>\n"]


def test_the_dry_run_refuses_the_tokenizer_that_the_run_refuses(check_only, chat, tmp_path):
    """A Qwen2 folder holding a PreTrainedTokenizerFast loads as Qwen2Tokenizer, which encodes text otherwise: the run
    refuses it, and so does the dry run, on plain text too (where it shows no example); an estimate needs none."""
    folder = chat[0]
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--data", str(chat[1].parent / "plain.txt")]
    (chat[1].parent / "plain.txt").write_text("2 plus 3 is 5.\n" * 400)
    assert_refused(check_only(tmp_path / "a", *args, "--dry_run"),
                   f"the tokenizer loaded from {folder} (Qwen2Tokenizer, chosen by transformers from the model type) "
                   f"is not the one saved there")
    assert check_only(tmp_path / "b", *args, "--dry_run", "--tokenizer", "saved").returncode == 0
    assert check_only(tmp_path / "c", *args, "--estimate").returncode == 0


def test_plain_text_documents_pack_and_learn_the_same_tokens(chat, test_env, tmp_path):
    """A .txt whose lines are documents of uneven length: each padded to a row of its own, most of the rows' positions
    were padding (--packing was refused: "plain text is cut into full blocks already"). Packed, the documents' pieces
    share rows, each isolated as packed examples are, and the model's losses over the learned tokens are those of the
    padded rows: the same tokens learned (sum and count of the token losses to 1e-5). Streamed rows (packed in the
    order the documents come) learn as many tokens."""
    import torch

    from trainkit.data.stream_rows import TextPieces

    folder, _ = chat
    docs = tmp_path / "docs.txt"
    docs.write_text("".join(" ".join(f"{a} plus {i % 5} is {a + i % 5}." for a in range(i % 9 + 1)) + "\n"
                            for i in range(40)))
    recipe = load_recipe("causal_lm")
    module = sys.modules["recipe_causal_lm"]
    settings = {"model_name_or_path": str(folder), "tokenizer": "saved", "data": str(docs), "seq_len": 96,
                "eval_fraction": 0.25}
    padded = [row for split in recipe.make_datasets(recipe.Config(**settings), tmp_path) for row in split]
    packed = [row for split in recipe.make_datasets(recipe.Config(**settings, packing=True), tmp_path) for row in split]
    share = {name: 1 - sum(int((r["attention_mask"]).sum()) for r in rows) / (96 * len(rows))
             for name, rows in (("padded", padded), ("packed", packed))}
    assert share["padded"] > 0.4 and share["packed"] < share["padded"] / 3, share
    model = recipe.build_model(recipe.Config(**settings)).eval()
    totals = {}
    with torch.no_grad():
        for name, rows in (("padded", padded), ("packed", packed)):
            batch = {key: torch.stack([r[key] for r in rows]) for key in rows[0]}
            losses, learned, _, _ = module._token_losses(model, batch)
            totals[name] = (float((losses * learned).sum()), int(learned.sum()))
    assert totals["packed"][1] == totals["padded"][1], totals
    assert totals["packed"][0] == pytest.approx(totals["padded"][0], rel=1e-5), totals
    tokenizer = module.tokenizer_of(recipe.Config(**settings))
    pieces = TextPieces(tokenizer, 96, packing=True)
    ids = [[*tokenizer(line, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
           for line in docs.read_text().splitlines()]
    streamed = list(pieces.pack(((doc, i) for i, doc in enumerate(ids)), 0))
    assert len(streamed) > 5 and all(row["input_ids"].shape == (96,) for row, _ in streamed)
    upto, start = streamed[-1][1]  # where the row after the last one starts: every piece before it is in a row
    before = [p for i, doc in enumerate(ids[:upto + 1]) for p, end in pieces.pieces(doc) if i < upto or end <= start]
    assert sum(int((row["labels"][1:] != sft.IGNORE).sum()) for row, _ in streamed) == \
        sum(len(p["input_ids"]) - 1 for p in before)


def test_dropout_trains_from_the_first_step_whatever_the_evaluations(chat, tmp_path):
    """from_pretrained returns a model in eval mode, and the runner never set train mode: a GPT-2 (dropout 0.1)
    fine-tuned without dropout (measured: model.training False at every step), and a pipeline's stages, which its
    evaluation put in train mode, with dropout from the first evaluation on (OPT cut into stages left one process's
    curve after the evaluation at step 3). Now dropout acts from step 1 (the loss differs from the same weights'
    without dropout), and the steps after an evaluation are those of a run that evaluates only at its end."""
    import torch
    from transformers import PreTrainedTokenizerFast

    folder, data = chat
    losses = {}
    for dropout in (0.1, 0.0):
        model = tmp_path / f"gpt2-{dropout}"
        torch.manual_seed(0)  # the same weights: only the dropout differs
        gpt2 = architecture("gpt2")
        gpt2.config.resid_pdrop = gpt2.config.embd_pdrop = gpt2.config.attn_pdrop = dropout
        gpt2.save_pretrained(model)
        PreTrainedTokenizerFast.from_pretrained(folder).save_pretrained(model)
        common = ["--recipe", "causal_lm", "--model_name_or_path", str(model), "--tokenizer", "saved", "--data",
                  str(data), "--chat_template", "chatml", "--seq_len", "96", "--max_steps", "4", "--batch_size", "4",
                  "--save_every", "0"]
        for every in ((2, 0) if dropout else (0,)):
            losses[dropout, every] = launch(tmp_path / f"out-{dropout}-{every}", *common, "--eval_every",
                                            str(every)).check().losses
    assert losses[0.1, 2] == losses[0.1, 0], losses
    assert losses[0.1, 0][0] != losses[0.0, 0][0], losses
