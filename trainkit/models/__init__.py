"""The model a recipe trains, and what trains it: loading, adapters, the optimizer, layers that save memory.

    pretrained.py          from_pretrained safely: safetensors unless allowed, failures with a fix, the tokenizer check
    finetune.py            what the fine-tuning recipes share: the model's settings, loading, tokenizer, export
    lora.py                LoRA through peft: the adapters, the merged model final/ holds
    quantised.py           QLoRA's 4- or 8-bit base (bitsandbytes): storage per strategy, kept frozen, bytes, final/
    optimizer.py           AdamW / SGD with weight decay on matrices, the warm-up + cosine schedule
    expert_bias.py         --router_bias_update_rate: a mixture of experts' routing biases moved toward an even load
    tiled_mlp.py           --tiled_mlp: each decoder layer's MLP a chunk of positions at a time
    activation_offload.py  --activation_offload: what the forward saves for backward kept in host memory

May import the spine (errors, config), data/sft.py (chat templates), strategies/pipeline_decoder.py (where a
decoder's layers are) and strategies/expert_parallel.py (which weights are a mixture's experts).
"""
