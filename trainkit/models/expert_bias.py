"""Auxiliary-loss-free load balancing (`--router_bias_update_rate`): the routing bias of a mixture of experts moved
toward an even load after every optimizer step, the rule DeepSeek-V3 trains with (Wang et al. 2024, "Auxiliary-Loss-
Free Load Balancing Strategy for Mixture-of-Experts"), as torchtitan implements it (its MoE's expert_bias,
tokens_per_expert and the optimizer's pre-step hook):

    load_i = tokens routed to expert i over the step's global batch (every micro-batch, every rank)
    delta_i = rate x sign(mean(load) - load_i);  bias_i += delta_i - mean(delta)

The bias is added to the router's scores only to choose the experts (Ernie4.5-MoE's moe_statics, DeepSeek-V3's and
GLM-4-MoE's gate): no loss reaches it, so it stays frozen for the optimizer (ROUTING_BIASES, frozen at load by
trainkit/models/finetune.py) and moves by this rule alone. The load is counted from the experts each trained router
chose in a training forward (not in evaluation, under no_grad, or in a backward's recomputation), padding included, and
summed over the ranks before the update: every rank moves its copy alike, and the global batch's count is one
process's whatever its split. The biases are saved with each checkpoint (routing_biases.safetensors, by
trainkit/run/checkpoint.py), so a resumed run goes on from them.
"""

from __future__ import annotations

from typing import Any

import torch

from trainkit.errors import ConfigError, Problem

# A router's expert bias that chooses the experts and takes no gradient (a parameter or a buffer, by family)
ROUTING_BIASES = ("e_score_correction_bias",)
SAVED = "routing_biases.safetensors"  # in a checkpoint's step folder


def biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's routing biases by name (parameters and buffers)."""
    return {name: tensor for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if name.endswith(ROUTING_BIASES)}


class Balancer:
    """The trained routers' expert counts since the last update, and the update."""

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate, self.routers = rate, []
        modules = dict(model.named_modules())
        for name, bias in biases(model).items():
            owner = name.rpartition(".")[0]
            # the module that chooses: the bias's owner, or its parent (Ernie's moe_statics sits in its router)
            router = next((modules[m] for m in (owner, owner.rpartition(".")[0]) if hasattr(modules[m], "top_k")), None)
            weight = getattr(router, "weight", None)
            if router is None or weight is None or not weight.requires_grad:
                continue  # a frozen model's (a reference, a teacher, a LoRA base): it keeps its bias
            counts = torch.zeros(bias.numel(), dtype=torch.float64, device=bias.device)
            self.routers.append((name, bias, counts))
            router.register_forward_hook(self._counter(counts))
        if not self.routers:
            raise ConfigError([Problem("--router_bias_update_rate: the model has no trained router with a routing "
                                       f"bias ({', '.join(ROUTING_BIASES)}): a DeepSeek-V3, GLM-4-MoE or "
                                       "Ernie4.5-MoE model, trained in full (not its LoRA adapters alone)",
                                       "--router_bias_update_rate", "drop --router_bias_update_rate")])

    @staticmethod
    def _counter(counts: torch.Tensor):
        def count(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not (module.training and torch.is_grad_enabled()) or torch._C._current_graph_task_id() != -1:
                return  # evaluation, a no_grad pass (a rollout), or activation checkpointing's recomputation
            chosen = output[-1]  # (router logits, weights, the chosen experts' indices)
            counts.add_(torch.bincount(chosen.reshape(-1), minlength=len(counts)).to(counts))
        return count

    def update(self) -> None:
        """Before the optimizer steps: each router's bias moved by the rule, its counts summed over the ranks."""
        import torch.distributed as dist

        loads = torch.cat([counts for _, _, counts in self.routers])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loads)
        start = 0
        with torch.no_grad():
            for _, bias, counts in self.routers:
                load = loads[start:start + len(counts)]
                delta = self.rate * torch.sign(load.mean() - load)
                bias.add_((delta - delta.mean()).to(bias).view_as(bias))
                counts.zero_()
                start += len(counts)


def strategy_problems(cfg: Any, strategy: Any) -> list[Problem]:
    """--router_bias_update_rate where each rank holds the whole model: one process, DDP, ZeRO-1/2 without expert or
    sequence parallelism; refused when the run is planned (the dry run too) under a strategy that shards or cuts it."""
    if getattr(cfg, "router_bias_update_rate", 0.0) <= 0:  # or a recipe without the field
        return []
    if strategy.name in ("single", "ddp") or (strategy.name == "deepspeed" and strategy.stage in (1, 2)
                                              and strategy.ep == 1 and strategy.sp == 1):
        return []
    return [Problem(f"--router_bias_update_rate under {strategy.label}: the update moves each rank's whole copy of a "
                    "router's bias, which this strategy shards or cuts", "--router_bias_update_rate",
                    "use ddp.yaml, deepspeed_zero1.yaml or deepspeed_zero2.yaml (+ offload), or drop "
                    "--router_bias_update_rate")]


def install(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rate: float) -> None:
    """--router_bias_update_rate > 0: count the routers' choices and move their biases before each optimizer step."""
    if rate > 0:
        balancer = Balancer(model, rate)
        optimizer.register_step_pre_hook(lambda *_: balancer.update())


def save(model: torch.nn.Module, step_dir) -> None:
    from safetensors.torch import save_file

    save_file({name: t.detach().cpu().contiguous() for name, t in biases(model).items()}, str(step_dir / SAVED))


def load(model: torch.nn.Module, step_dir) -> None:
    """The biases a checkpoint saved, if it saved any, into the model."""
    from safetensors.torch import load_file

    if (step_dir / SAVED).exists():
        found = biases(model)
        with torch.no_grad():
            for name, tensor in load_file(str(step_dir / SAVED)).items():
                found[name].copy_(tensor.to(found[name]))
