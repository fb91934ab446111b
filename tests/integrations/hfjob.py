"""A Hugging Face Trainer job recorded with the two lines of docs/integrations.md: a tiny model
made here (no download), a synthetic map-style dataset, gradient accumulation, clipping, AdamW
and a linear warmup schedule, checkpoints every ``--save-steps``. One process per rank with the
launcher's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)::

    python -c 'import tests.integrations.hfjob as j; j.run()' --trace T --out O [--steps 6] [--save-steps 3] [--inject SPEC] [--resume DIR] [--policy raise] [--interrupt-at STEP] [--collator padding|lm]

The model class and the dataset function are referenced by the trace as
``tests.integrations.hfjob:...``: replay imports them with ``PYTHONPATH`` set to the repository.

``--collator`` trains a GPT-2 (a tiny config made here, its default dropout 0.1) on sentences of 1 to
8 words, tokenized by a word-level tokenizer made here (no download), through a stock collator
(each returns a ``BatchEncoding``): ``padding`` is the Trainer's own default given
``processing_class=tokenizer`` and no collator (``DataCollatorWithPadding``, behind its column
remover), a sequence classifier on a ``label`` column; ``lm`` is
``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` for a causal LM. Both models take
``**kwargs``: the Trainer normalises the loss by ``num_items_in_batch``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

from tests.integrations.launch import run_and_leave

FEATURES, CLASSES, SAMPLES = 8, 4, 48


class TinyConfig(PretrainedConfig):
    model_type = "sdc-tiny"

    def __init__(self, width: int = 16, dropout: float = 0.0, **kwargs) -> None:
        self.width, self.dropout = width, dropout
        super().__init__(**kwargs)


class TinyModel(PreTrainedModel):
    """Linear, LayerNorm, tanh, dropout (p=0 unless asked), linear; its forward takes no **kwargs (the Trainer divides the loss
    by the accumulation count)."""

    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.inp = nn.Linear(FEATURES, config.width)
        self.norm = nn.LayerNorm(config.width)
        self.drop = nn.Dropout(config.dropout)
        self.out = nn.Linear(config.width, CLASSES)

    def forward(self, x, labels=None):
        logits = self.out(self.drop(torch.tanh(self.norm(self.inp(x)))))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class Points(torch.utils.data.Dataset):
    """Sample ``i``: 8 features from a generator seeded with ``i``, and a label they decide."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict:
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(1000 + int(index)))
        return {"x": x, "labels": int(x[:CLASSES].argmax())}


class Interrupt(TrainerCallback):
    """Ctrl+C inside optimizer step ``step`` (after the recording callback began it), on every rank."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt


def make_dataset() -> Points:
    """The training dataset, rebuilt by replay (the function ``hf.record(dataset=...)`` names)."""
    return Points()


WORDS = "the a cat dog sat ran on mat".split()


def make_tokenizer():
    """A word-level tokenizer built here (no download): the stock collators need one to pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")


def _text_rows(tokenizer) -> list[dict]:
    """Sample ``i``: a sentence of 1..8 words drawn from a generator seeded with ``i``, tokenized,
    with its text (a column the Trainer removes) and a class label (whether "cat" is in it)."""
    rows = []
    for i in range(SAMPLES):
        g = torch.Generator().manual_seed(2000 + i)
        n = int(torch.randint(1, 9, (1,), generator=g))
        text = " ".join(WORDS[int(j)] for j in torch.randint(0, len(WORDS), (n,), generator=g))
        rows.append({**dict(tokenizer(text)), "text": text, "label": int("cat" in text.split())})
    return rows


def make_padded_text():
    """``--collator padding``: the rows and the collator the Trainer made from the tokenizer."""
    from transformers import DataCollatorWithPadding

    tokenizer = make_tokenizer()
    return _text_rows(tokenizer), DataCollatorWithPadding(tokenizer)


def make_lm_text():
    """``--collator lm``: the rows (no class label) and the causal-LM collator."""
    from transformers import DataCollatorForLanguageModeling

    tokenizer = make_tokenizer()
    rows = [{k: v for k, v in r.items() if k != "label"} for r in _text_rows(tokenizer)]
    return rows, DataCollatorForLanguageModeling(tokenizer, mlm=False)


def _gpt2_config(**kwargs):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=16,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **kwargs,
    )


def _text_trainer(kind: str, args: TrainingArguments) -> tuple[Trainer, str]:
    """The Trainer of ``--collator kind`` and the dataset function replay names."""
    from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

    tokenizer = make_tokenizer()
    if kind == "padding":  # no collator: the Trainer's default from processing_class, DataCollatorWithPadding
        rows, _ = make_padded_text()
        trainer = Trainer(
            model=GPT2ForSequenceClassification(_gpt2_config(num_labels=2)),
            args=args,
            train_dataset=rows,
            processing_class=tokenizer,
        )
        assert type(trainer.data_collator).__name__ == "DataCollatorWithPadding"
        return trainer, "tests.integrations.hfjob:make_padded_text"
    rows, collator = make_lm_text()
    trainer = Trainer(model=GPT2LMHeadModel(_gpt2_config()), args=args, train_dataset=rows, data_collator=collator)
    return trainer, "tests.integrations.hfjob:make_lm_text"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--inject", action="append", default=[])
    parser.add_argument("--resume", default=None)
    parser.add_argument(
        "--dropout", type=float, default=0.0, help="dropout after the hidden layer (replayed: the adapter seeds it)"
    )
    parser.add_argument(
        "--policy", default="continue", help="the recorder's policy: raise stops training at an alarm (exit 18)"
    )
    parser.add_argument(
        "--workers", type=int, default=0, help="dataloader_num_workers: the indices cross process boundaries"
    )
    parser.add_argument(
        "--interrupt-at", type=int, default=None, help="raise KeyboardInterrupt on every rank inside this step"
    )
    parser.add_argument(
        "--collator",
        choices=["padding", "lm"],
        default=None,
        help="a GPT-2 on variable-length text through a stock collator (the module docstring)",
    )
    opts = parser.parse_args(argv)
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=opts.out,
        max_steps=opts.steps,
        save_steps=opts.save_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=opts.accumulate,
        learning_rate=5e-2,
        weight_decay=0.01,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_grad_norm=0.5,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        logging_steps=1000,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=opts.workers,
    )
    if opts.collator is None:
        trainer = Trainer(
            model=TinyModel(TinyConfig(width=16, dropout=opts.dropout)), args=args, train_dataset=make_dataset()
        )
        assert (
            not trainer.model_accepts_loss_kwargs
        )  # the accumulation divisor path (docs/integrations.md's GPT-2 takes the other)
        dataset = "tests.integrations.hfjob:make_dataset"
    else:
        trainer, dataset = _text_trainer(opts.collator, args)
        assert trainer.model_accepts_loss_kwargs  # the num_items_in_batch path

    from sdc_forensics.integrations import hf
    from sdc_forensics.recorder import RecorderOptions, exit_on_alarm

    hf.record(trainer, opts.trace, dataset=dataset, options=RecorderOptions(policy=opts.policy), inject=opts.inject)
    if opts.interrupt_at is not None:
        trainer.add_callback(Interrupt(opts.interrupt_at))  # after hf.record's callback: the step has begun
    with exit_on_alarm():  # an online check's alarm: one line and exit 18, the trace closed by the adapter
        trainer.train(resume_from_checkpoint=opts.resume)


def run() -> None:
    """``main()`` as a launched rank runs it (``launch.run_and_leave``)."""
    run_and_leave(main)


if __name__ == "__main__":
    run()
