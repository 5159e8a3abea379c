"""What a run leaves on disk and how it stops.

    checkpoint.py     atomic step_<N> folders, latest, pruning, RNG and data position, checksums, resume, final/
    output_folder.py  the output folder: what a new run may replace, its lock, every machine seeing it, stopped.json
    metrics.py        metrics.jsonl, trackers, the progress bar, throughput, MFU, state and peak memory
    stopping.py       what stops a run between two steps: SIGTERM / SIGINT, a loss or gradient norm not finite
    restarts.py       a launch's attempts under --max_restarts: torchrun's report, refusals not restarted

May import the spine, data/ (the data position a checkpoint keeps), launch/ (a lost peer), strategies/ (the
checkpoint formats) and models/expert_bias.py (the routing biases a checkpoint keeps). restarts.py is imported before
torch (train.py's first line) and imports nothing heavy.
"""
