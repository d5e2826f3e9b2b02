"""`dgemma train`: fine-tune a checkpoint or train from scratch (diffusion objective or AR baseline, LoRA).

    dgemma train --model DIR --data train.jsonl --out runs/ft --lora --steps 2000
    dgemma train --init preset:tiny --vocab-size 16 --set canvas_length=81 --data sudoku.jsonl --out runs/s
    dgemma train ... --resume                       # continue the run in --out after a kill
    torchrun --nproc-per-node 2 -m dgemma train ... # FSDP2 over 2 processes (gloo on CPU, NCCL on GPU)
    dgemma train ... --memory-per-rank 80GB          # refuse, before loading weights, a run that cannot fit
"""

from __future__ import annotations

import argparse

from dgemma.commands._common import add_revision_argument


def _size(text: str) -> int:
    from dgemma.convert import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p):
    src = p.add_argument_group("model")
    pick = src.add_mutually_exclusive_group(required=True)
    pick.add_argument("--model", help="Hugging Face format folder or Hugging Face id to fine-tune")
    add_revision_argument(p)
    pick.add_argument("--init", help="train from scratch: preset:NAME (e.g. preset:tiny) or a config JSON file")
    src.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                     help="override a model field with --init (repeatable), e.g. --set hidden_size=128")
    src.add_argument("--vocab-size", type=int, help="with --init: vocabulary size (pre-tokenised data)")
    src.add_argument("--objective", choices=["diffusion", "ar"], default="diffusion",
                     help="diffusion (DiffusionGemma) or ar (autoregressive baseline: encoder + LM head)")

    data = p.add_argument_group("data")
    data.add_argument("--data", required=True, help="JSONL: prompt_ids/response_ids, prompt/response, or messages")
    data.add_argument("--tokenizer", help="folder with tokenizer.json for text data (default: the --model folder)")
    data.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                      help="tokenise prompt/response records as plain text (BOS + prompt, response + EOS)")
    data.add_argument("--max-length", type=int, help="longest prompt + filled response (default: model context)")
    data.add_argument("--eos-id", type=int, help="token that fills the response to a canvas boundary")
    data.add_argument("--augment", choices=["sudoku"],
                      help="draw a fresh random transform of every example at every step (sudoku: a symmetry)")
    data.add_argument("--skip-bad-lines", action="store_true",
                      help="leave out malformed lines (reported on stderr) instead of stopping at the first")

    opt = p.add_argument_group("optimisation")
    opt.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    opt.add_argument("--until", type=int, metavar="STEP",
                     help="stop after this step with a checkpoint, keeping the --steps schedule (resume to go on)")
    opt.add_argument("--batch-size", type=int, default=8, help="global examples per step (default 8)")
    opt.add_argument("--micro-batch-size", type=int, help="examples per process and forward (gradient accumulation)")
    opt.add_argument("--lr", type=float, default=1.5e-4, help="peak learning rate (default 1.5e-4)")
    opt.add_argument("--min-lr", type=float, help="learning rate at the end of the cosine (default lr/10)")
    opt.add_argument("--warmup-steps", type=int, default=100)
    opt.add_argument("--weight-decay", type=float, default=1e-4)
    opt.add_argument("--betas", type=float, nargs=2, default=(0.95, 0.99), metavar=("B1", "B2"))
    opt.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm, 0 = off (default 1.0)")
    opt.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16 = autocast")
    opt.add_argument("--mixed-precision", choices=["bf16"],
                     help="FSDP2 MixedPrecisionPolicy (torchrun, 2+ processes): bf16 gathered weights and "
                          "compute, fp32 gradient reduction, fp32 sharded master weights and AdamW")
    opt.add_argument("--activation-checkpointing", action="store_true",
                     help="keep only each block's input; recompute its activations in the backward")
    opt.add_argument("--seed", type=int, default=0)
    opt.add_argument("--noise-eps", type=float, default=1e-3, help="t ~ U(eps, 1) (default 1e-3)")
    opt.add_argument("--self-cond-prob", type=float, default=0.5)
    opt.add_argument("--encoder-loss-weight", type=float, default=1.0)
    opt.add_argument("--train-router", action="store_true", help="let the MoE routers learn (frozen by default)")

    lora = p.add_argument_group("LoRA")
    lora.add_argument("--lora", action="store_true", help="train low-rank adapters only (merged on export)")
    lora.add_argument("--lora-rank", type=int, default=16)
    lora.add_argument("--lora-alpha", type=float, default=32.0)
    lora.add_argument("--lora-targets",
                      help="comma-separated module-name suffixes (default: attention q/k/v/o_proj and the dense "
                           "mlp.gate/up/down_proj); add 'experts' for the fused experts")
    lora.add_argument("--lora-dropout", type=float, default=0.0)

    run = p.add_argument_group("run")
    run.add_argument("--out", required=True, help="run folder: checkpoints/, model/, metrics.jsonl, loss.png")
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    run.add_argument("--save-every", type=int, default=500)
    run.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept (0: all; default 2)")
    run.add_argument("--log-every", type=int, default=10)
    run.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    run.add_argument("--memory-per-rank", type=_size, metavar="SIZE",
                     help="memory each process may use (e.g. 80GB, 80GiB): a run whose plan (see `dgemma info "
                          "--train`) needs more is refused before any weight is loaded")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar or lines")


def config_from_args(args):
    from dgemma.training import TrainConfig
    from dgemma.training.lora import DEFAULT_TARGETS
    from dgemma.training.model_setup import parse_override

    overrides = dict(parse_override(o) for o in args.overrides)
    if args.vocab_size is not None:
        overrides["vocab_size"] = args.vocab_size
    return TrainConfig(
        data=args.data, out=args.out, model=args.model, init=args.init, model_overrides=overrides,
        tokenizer=args.tokenizer, chat_template=args.chat_template, objective=args.objective,
        steps=args.steps, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size, lr=args.lr,
        min_lr=args.min_lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        betas=tuple(args.betas), grad_clip=args.grad_clip, precision=args.precision, seed=args.seed,
        mixed_precision=args.mixed_precision, activation_checkpointing=args.activation_checkpointing,
        memory_per_rank=args.memory_per_rank,
        noise_eps=args.noise_eps, self_cond_prob=args.self_cond_prob, encoder_loss_weight=args.encoder_loss_weight,
        train_router=args.train_router, lora=args.lora, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        lora_targets=(DEFAULT_TARGETS if args.lora_targets is None
                      else tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())),
        lora_dropout=args.lora_dropout, max_length=args.max_length, eos_id=args.eos_id, augment=args.augment,
        until=args.until,
        skip_bad_lines=args.skip_bad_lines, save_every=args.save_every, keep_checkpoints=args.keep_checkpoints,
        log_every=args.log_every, resume=args.resume, device=args.device, progress=args.progress,
    )


def run(args):
    from dgemma.training import train

    result = train(config_from_args(args))
    if result.metrics:
        print(f"final loss {result.final_loss:.4f} after {result.steps} steps "
              f"({result.steps_per_s:.2f} steps/s); model: {result.model_dir}")
    return 0
