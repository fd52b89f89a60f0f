"""Fine-tune with LoRA (peft) and TRL's SFTTrainer, checkpointing and offloading through ckpt_offload.

Everything is built here (a tiny Llama from a config, a word-level tokenizer, a dataset of varying
lengths): nothing comes from a hub. On the CPU set CKPT_OFFLOAD_TEST_CPU=1, which sends CPU tensors
through the pool and the engine as a GPU's would go.

    CKPT_OFFLOAD_TEST_CPU=1 python examples/sft_lora.py --steps 4

--route picks how ckpt_offload is turned on: "enable" (hf.enable on the model before the trainer,
which keeps it when SFTTrainer turns transformers' checkpointing on again), "callback"
(hf.OffloadCallback with hf.install_checkpointing_args(offload=True)) or "install" (hf.install(): the
trainer's own offload=True through the engine). --no-offload runs the same training with
transformers' own checkpointing, for comparison.
"""
import argparse
import random
import sys
import warnings

import torch

import ckpt_offload
from ckpt_offload.integrations import hf

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing in tall green trees "
         "near one quiet river under bright morning light").split()


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def dataset(n, lengths, seed=0):
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_dict({"text": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*lengths)))
                                       for _ in range(n)]})


def model(vocab_size, layers):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(cfg)


class StepReport:
    """A TrainerCallback that prints, per step: the loss, tensors offloaded and host allocations."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Report(TrainerCallback):
            def __init__(self):
                self.rows, self.losses = [], {}
                self._before = None
                self.length = 0

            def see(self, module, args, kwargs):  # a forward pre-hook on the model: the padded length
                ids = kwargs.get("input_ids", args[0] if args else None)
                if isinstance(ids, torch.Tensor):
                    self.length = max(self.length, ids.shape[-1])

            def on_step_begin(self, args, state, control, **kw):
                ckpt_offload.synchronize()
                self._before = ckpt_offload.stats()
                self.length = 0

            def on_step_end(self, args, state, control, **kw):
                ckpt_offload.synchronize()
                s, b = ckpt_offload.stats(), self._before
                self.rows.append((state.global_step, self.length, s["tensors_offloaded"] - b["tensors_offloaded"],
                                  s["host_alloc_calls"] - b["host_alloc_calls"], s["host_in_use_bytes"]))

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "loss" in logs:
                    self.losses[state.global_step] = logs["loss"]

        return _Report()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--route", choices=("enable", "callback", "install"), default="enable")
    p.add_argument("--no-offload", action="store_true", help="transformers' own checkpointing, no offload")
    p.add_argument("--output-dir", default="/tmp/ckpt_offload_sft_lora")
    a = p.parse_args(argv)

    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    tok = tokenizer()
    net = model(len(tok), a.layers)
    callbacks = [report := StepReport()]
    net.register_forward_pre_hook(report.see, with_kwargs=True)
    # transformers' own checkpointing, under the names of the installed release (activation_checkpointing
    # since 5.2x renamed it, gradient_checkpointing before); offload=False installs nothing.
    gc_args = hf.install_checkpointing_args(offload=False, use_reentrant=False)
    if a.no_offload:
        pass
    elif a.route == "enable":
        hf.enable(net, offload=True, keep_last=1)
    elif a.route == "callback":
        gc_args = hf.install_checkpointing_args(offload=True)
        hf.uninstall()  # the callback alone, without the routing install_checkpointing_args installs
        callbacks.append(hf.OffloadCallback(keep_last=1))
    else:
        hf.install()
        gc_args = hf.install_checkpointing_args(offload=True)
    config = SFTConfig(output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=4, learning_rate=1e-3,
                       logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                       dataloader_num_workers=0, max_length=64, **gc_args)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = SFTTrainer(model=net, args=config, train_dataset=dataset(64, (4, 40)), processing_class=tok,
                             peft_config=lora, callbacks=callbacks)
        trainer.train()
    for w in caught:
        if "ckpt_offload" in str(w.message):
            print("warning:", w.message)
    print(f"model: {type(trainer.model).__name__}; checkpointing_state: {ckpt_offload.checkpointing_state(trainer.model)}")
    print("step | length | loss | tensors_offloaded | host allocations | host bytes in use")
    for step, length, offloaded, allocs, in_use in report.rows:
        print(f"{step} | {length} | {report.losses.get(step, float('nan')):.4f} | {offloaded} | {allocs} | {in_use}")
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    print(f"trainable: {len(trained)} tensors, all LoRA: {all('lora_' in n for n in trained)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
