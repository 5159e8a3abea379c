"""Samples to per-rank micro-batches, keeping the order invariant: the global batches depend only on the seed and the
global batch size, never on the world size or the strategy.

    batches.py         datasets -> per-rank micro-batches; the global batch order; global_batch_size
    text.py            the built-in corpus, --data loading, the BPE tokenizer trained on it, token blocks
    sft.py             instruction and chat layouts, chat templates, answer-only labels, packed rows and their mask
    preference.py      preference pairs in TRL's layouts (recipes/dpo.py, recipes/reward.py)
    precompute.py      values computed per sample before the first step, carried with their samples
    stream.py          --streaming: lanes, the mixture's draws, data workers, positions kept in checkpoints
    stream_sources.py  what --data names when streamed: globs, weights, mixtures, pieces readable from any position
    stream_rows.py     streamed records to rows: text blocks and pieces, instruction and chat examples

May import the spine (errors, config), models/ (a recipe's tokenizer) and launch/hardware.py (data workers).
"""
