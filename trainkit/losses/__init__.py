"""Objectives: what a recipe's loss computes from a model's outputs, each formula cited from its paper.

    chunked_loss.py  the next-token loss a chunk of positions at a time (--loss_chunk_mib): the whole logits never held
    dpo.py           the DPO family over pairs (sigmoid, IPO, hinge, SimPO, ORPO) and TRL's metric names
    grpo.py          GRPO and its family (grpo, dr_grpo, dapo, bnpo): advantages, the clipped loss, TRL's metric names
    router.py        a mixture of experts' balancing loss (the model's aux_loss x its coefficient), kept

May import the spine (errors) and torch; nothing that knows about data, strategies or runs.
"""
