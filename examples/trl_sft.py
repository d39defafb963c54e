"""A TRL SFTTrainer script as users have it: nothing of slipstream in it. The DeepSpeed config
named on the command line decides (a "slipstream" section with "varlen" also removes the
padding inside the model, under TRL's own fused LM head).

    torchrun --nproc-per-node 2 examples/trl_sft.py ds_config.json

A tiny Llama, a word-level tokenizer built here and random text stand in for yours.
"""

import sys

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

words = [f"w{i}" for i in range(120)]
vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", *words])}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
g = torch.Generator().manual_seed(0)
lengths = torch.randint(3, 40, (64,), generator=g).tolist()  # variable lengths: mostly padding
data = Dataset.from_list([{"text": " ".join(words[j] for j in torch.randint(0, 120, (n,), generator=g))}
                          for n in lengths])

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     pad_token_id=0, eos_token_id=1))
args = SFTConfig(output_dir="out", deepspeed=sys.argv[1], per_device_train_batch_size=4, max_steps=5,
                 logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                 bf16=False)  # float32 on CPU (SFTConfig turns bf16 on by default)
trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
trainer.train()
if trainer.is_world_process_zero():
    print("losses", [h["loss"] for h in trainer.state.log_history if "loss" in h])
