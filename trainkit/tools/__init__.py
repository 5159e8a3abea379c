"""The commands users type beside training; nothing in trainkit/ or recipes/ imports them.

    python -m trainkit.tools.ask FOLDER "question"   a fine-tuned model's (or adapter's) answer, its chat template
    python -m trainkit.tools.catalog ls | cp          list the shipped recipes and configs; copy one to make it yours
    python -m trainkit.tools.compare --configs ...    one recipe under several configs against one process, plotted
    python -m trainkit.tools.plot RUN_DIR ...         run folders side by side in one PNG
    python -m trainkit.tools.upcycle DENSE OUT        a mixture of experts made from a dense model (sparse upcycling)

May import anything in the package.
"""
