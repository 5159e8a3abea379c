"""Every parallelism: a strategy per launch family, one module each, and the pieces they share.

    registry.py           the registry that picks the strategy of a launch (for_launch), and for_format
    base.py               the interface at plan time (Strategy): checks, resolved fields, labels, the estimate
    engine.py             what a strategy builds and runs (Engine): the Accelerator, prepare, the step's points
    accelerator.py        the Accelerator built for an engine and verified (N unsynchronised copies refused)
    dcp_format.py         the checkpoint format's interface, and torch.distributed.checkpoint's format
    ddp.py                one process, and DDP
    deepspeed.py          DeepSpeed ZeRO-1/2/3, with or without CPU offload (its own engine and step)
    deepspeed_format.py   DeepSpeed's own checkpoints, and its universal format across world sizes
    deepspeed_config.py   DeepSpeed's config: JSON or inline YAML keys, "auto" values, bucket sizes
    fsdp.py               an FSDP launch: FSDP2, HSDP, tensor and context parallelism as sizes of one mesh
    parallel_dims.py      the one device mesh: the sizes of (pp, dp_replicate, dp_shard, cp, tp)
    parallelize.py        the mesh applied to a model or a stage: TP, checkpointing, compile, FSDP2, in that order
    tp_plan.py            which Linear layers tensor parallelism cuts
    pipeline.py           pipeline stages (torch.distributed.pipelining) x any data-parallel or FSDP launch
    pipeline_stages.py    a pipeline's cut points, names, a timed PipelineStage, weighed micro-batch losses
    pipeline_decoder.py   the stages of any transformers decoder of the standard layout (found, not named)
    sequence_parallel.py  DeepSpeed's Ulysses and context parallelism: sequences cut per rank, losses weighed

May import the spine, data/, run/stopping.py and launch/; nothing here imports run/checkpoint.py (a checkpoint
format reads its engine through a protocol). This file imports nothing, so that importing one module of the folder
(tp_plan.py from estimate.py) does not bring in every strategy.
"""
