"""``training.main(args)``: build data, model (exact or Mesa), optimizer and schedule from the
arguments of :mod:`training.args`, then train (DeiT's recipe), evaluate (``--eval``) or time
training (``--train-throughput``)."""
from __future__ import annotations

import copy
import datetime
import glob
import os
import random
import time

import numpy as np
import torch
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3

import data
import mesa_ops as ms
import models
from mesa_ops import planner

from . import checkpoint as ckpt
from . import fsdp, memory
from .args import args_to_dict
from .distributed import all_gather_object, barrier, cleanup, get_rank, init_distributed_mode, is_main_process
from .engine import evaluate, make_scaler, train_one_epoch, train_throughput
from .errors import UsageError
from .runfolder import check_classes, check_patch_size, lock_folder, remove_temporaries
from .logs import JsonLog, TensorBoard, log, save_args

__all__ = ["RUN_FILES", "UsageError", "build_model", "build_optimizer", "main", "resolve_args", "run_files"]

# what a training run writes into --output-dir (glob patterns)
RUN_FILES = ("checkpoint.pth", "best_checkpoint.pth", "log.txt", "args.json", "events.out.tfevents.*",
             "rank*_state.pth", "memory_plan.txt")


def resolve_args(args):
    """Check the arguments and fill the defaults that depend on the machine or data set."""
    args.data_set = data.datasets.canonical_name(args.data_set)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device here (use --device cpu)")
    if args.amp is None:
        args.amp = "fp16" if str(args.device).startswith("cuda") else "none"
    if args.input_size is None:
        args.input_size = data.dataset_defaults(args.data_set)["input_size"]
    if not models.is_model(args.model):
        raise UsageError(f"unknown model {args.model!r}; known: {', '.join(models.list_models())}")
    if args.ms_policy and not os.path.isfile(args.ms_policy):
        raise UsageError(f"--ms-policy {args.ms_policy}: no such file (the paper's are in configs/mesa/)")
    _check_memory_args(args)
    for flag, path in (("--resume", args.resume), ("--finetune", args.finetune)):
        if path and "://" not in path and not os.path.isfile(path) and not (
                flag == "--resume" and fsdp.is_sharded_checkpoint(path)):
            raise UsageError(f"{flag} {path}: no such file (or checkpoint folder)")
    if args.model_ema_eval and not args.model_ema and not args.eval:
        raise UsageError("--model-ema-eval with --no-model-ema: there is no EMA to evaluate")
    if args.eval and args.compile:
        raise UsageError("--compile applies to training; --eval evaluates the model as it is (drop --compile)")
    if args.fsdp and args.compile:
        raise UsageError("--compile with --fsdp: not supported yet (compile a model without --fsdp)")
    if args.fsdp and args.model_ema and args.model_ema_force_cpu and not args.eval:
        raise UsageError("--fsdp: --model-ema-force-cpu does not apply: the model EMA is sharded as the weights "
                         "are (each rank keeps the EMA of its own shards)")
    if args.fsdp and args.resume and not fsdp.is_sharded_checkpoint(args.resume) and not args.eval:
        raise UsageError(f"--fsdp --resume {args.resume}: continuing training needs a checkpoint folder "
                         "of an --fsdp run (<output-dir>/checkpoint); a file loads with --eval or --finetune")
    if args.eval and not args.resume:
        raise UsageError("--eval needs --resume PATH_OR_URL (the checkpoint to evaluate)")
    if (args.batch_size != "auto" and args.batch_size < 1) or args.epochs < 1:
        raise UsageError("--batch-size and --epochs must be >= 1")
    _check_output_dir(args)
    return args


def _check_memory_args(args) -> None:
    plan, budget = getattr(args, "ms_plan", None), getattr(args, "memory_budget_gb", None)
    chosen = [f for f, v in (("--ms-policy", args.ms_policy), ("--ms-plan", plan), ("--memory-budget-gb", budget))
              if v]
    if len(chosen) > 1:
        raise UsageError(f"{' and '.join(chosen)}: give one (each sets the Mesa layers and checkpointing)")
    if (plan or budget) and args.mesa_bits:
        raise UsageError(f"--mesa-bits with {chosen[0]}: a memory plan chooses the bits per layer")
    if plan:
        if not os.path.isfile(plan):
            raise UsageError(f"--ms-plan {plan}: no such file (write one with tools/plan_memory.py --out)")
        if planner.read_plan(plan) is None:
            raise UsageError(f"--ms-plan {plan}: not a memory plan (no '# mesa-plan:' line; tools/plan_memory.py "
                             "--out writes one); a plain policy file goes to --ms-policy")
    if budget is not None and budget <= 0:
        raise UsageError(f"--memory-budget-gb {budget:g}: must be > 0")
    if args.batch_size == "auto" and budget is None:
        raise UsageError("--batch-size auto needs --memory-budget-gb (the batch is the largest whose plan fits)")
    if budget is not None and args.eval:
        raise UsageError("--memory-budget-gb plans training memory; not with --eval")
    axis = getattr(args, "scale_model", None)
    if axis:
        if budget is None:
            raise UsageError(f"--scale-model {axis} needs --memory-budget-gb (the budget the model grows into)")
        if args.batch_size == "auto":
            raise UsageError("--scale-model with --batch-size auto: give the batch (one of the two grows)")
        if args.resume or args.finetune:
            raise UsageError(f"--scale-model {axis}: not with --resume / --finetune (their weights fix the size)")
        clash = set(models.scale.variant_kwargs(args.model, axis, 1)) & set(args.model_kwargs or {})
        if clash:
            raise UsageError(f"--scale-model {axis} sets {', '.join(sorted(clash))}: drop it from --model-kwargs")


def run_files(output_dir: str) -> list[str]:
    """The files of a training run in ``output_dir`` (:data:`RUN_FILES`), sorted by name."""
    if not output_dir or not os.path.isdir(output_dir):
        return []
    return sorted({os.path.basename(p) for pat in RUN_FILES for p in glob.glob(os.path.join(output_dir, pat))})


def _check_output_dir(args) -> None:
    """An --output-dir holding a run is continued (--resume) or started afresh (--overwrite),
    never silently mixed with a new run (evaluation and --train-throughput write nothing)."""
    if args.eval or args.train_throughput or args.resume or args.overwrite:
        return
    found = run_files(args.output_dir)
    if found:
        raise UsageError(
            f"--output-dir {args.output_dir} holds a run already ({', '.join(found)}): continue it with "
            f"--resume {os.path.join(args.output_dir, 'checkpoint.pth')}, or pass --overwrite to delete "
            "those files and start afresh")


def _clear_output_dir(output_dir: str, keep=()) -> list[str]:
    """Delete the run's files, except those in ``keep`` (the plan or policy this run reads);
    returns the names deleted."""
    keep = {os.path.realpath(k) for k in keep if k}
    removed = [n for n in run_files(output_dir) if os.path.realpath(os.path.join(output_dir, n)) not in keep]
    for name in removed:
        os.unlink(os.path.join(output_dir, name))
    return removed


def build_model(args, num_classes: int):
    """The model of ``args.model`` with Mesa per ``--ms-policy`` / ``--mesa-bits``."""
    kwargs = dict(num_classes=num_classes, drop_rate=args.drop, drop_path_rate=args.drop_path)
    if args.input_size != 224:
        kwargs["img_size"] = args.input_size
    kwargs.update(args.model_kwargs or {})
    try:
        model = models.create_model(args.model, **kwargs)
    except TypeError as exc:
        raise UsageError(f"--model {args.model} with {kwargs}: {exc}") from exc
    if args.finetune:  # as DeiT: a classifier of another shape stays at its initialisation
        sd, _ = models.checkpoint.extract_state_dict(read_checkpoint(args, args.finetune), args.finetune)
        filt = getattr(model, "checkpoint_filter", None)
        sd = filt(sd) if filt is not None else sd
        own = model.state_dict()
        skip = [k for k in sd
                if k.startswith(("head.", "head_dist.")) and k in own and sd[k].shape != own[k].shape]
        models.load_checkpoint(model, sd, skip=skip, verbose=log, reset_quantizers=True)
    policy = args.ms_policy or getattr(args, "ms_plan", None)
    if policy:
        try:
            planner.apply_plan(model, policy, verbose=log)
        except planner.PlanError as exc:
            raise UsageError(str(exc)) from exc
        if args.mesa_bits:
            for _, m in ms.policy.mesa_layers(model):
                if m.enable:
                    m.bits = args.mesa_bits
    elif args.mesa_bits:
        models.apply_policy(model, f"mesa{args.mesa_bits}", verbose=log)
    if policy:
        flag = "--ms-policy" if args.ms_policy else "--ms-plan"
        warning = memory.exact_policy_warning(model, f"{flag} {policy}")
        if warning:
            memory.warn_loudly(warning)
    if hasattr(ms, "set_dist_sync"):
        ms.set_dist_sync(model, not args.no_mesa_dist_sync)
    return model


def build_optimizer(args, model, updates_per_epoch: int):
    """(optimizer, lr scheduler) of ``args`` (``--opt``, ``--lr`` as already scaled, ``--sched``
    ...) for ``model``; the scheduler steps per update with ``--sched-on-updates``."""
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr,
                                    weight_decay=args.weight_decay, momentum=args.momentum, eps=args.opt_eps,
                                    **({"betas": tuple(args.opt_betas)} if args.opt_betas else {}))
    lr_scheduler, _ = create_scheduler_v2(
        optimizer, sched=args.sched, num_epochs=args.epochs, decay_epochs=args.decay_epochs,
        cooldown_epochs=args.cooldown_epochs, patience_epochs=args.patience_epochs,
        decay_rate=args.decay_rate,
        min_lr=args.min_lr, warmup_lr=args.warmup_lr, warmup_epochs=args.warmup_epochs, noise=args.lr_noise,
        noise_pct=args.lr_noise_pct, noise_std=args.lr_noise_std, noise_seed=args.seed,
        step_on_epochs=not args.sched_on_updates, updates_per_epoch=updates_per_epoch)
    return optimizer, lr_scheduler


def lr_line(lr: float, base_lr: float, global_batch: int, unscaled: bool) -> str:
    """How the learning rate in use came about, for the start line."""
    if unscaled:
        return f"{lr:.3g} as given, --unscale-lr: not scaled by the global batch {global_batch}"
    return f"{lr:.3g} = {base_lr:g} x {global_batch} / 512"


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _common(args) -> dict:
    return dict(num_workers=args.num_workers, pin_memory=args.pin_mem and args.device.startswith("cuda"),
                persistent_workers=False)


def _train_loader(args, dist_info, train_set):
    world, rank = dist_info.world_size, dist_info.rank
    if dist_info.distributed and args.repeated_aug:
        sampler_train = data.RASampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    else:  # DistributedSampler also for one process: its order depends on seed + epoch only
        sampler_train = torch.utils.data.DistributedSampler(train_set, num_replicas=world, rank=rank,
                                                            shuffle=True, seed=args.seed)
    if len(sampler_train) < args.batch_size:
        raise UsageError(f"--batch-size {args.batch_size} is larger than this rank's "
                         f"{len(sampler_train)} training images")
    train = torch.utils.data.DataLoader(train_set, sampler=sampler_train, batch_size=args.batch_size,
                                        drop_last=True, **_common(args))
    return train, sampler_train


def _val_loader(args, dist_info, val_set):
    if dist_info.distributed and args.dist_eval:
        sampler_val = torch.utils.data.DistributedSampler(val_set, num_replicas=dist_info.world_size,
                                                          rank=dist_info.rank, shuffle=False)
    else:
        sampler_val = torch.utils.data.SequentialSampler(val_set)
    return torch.utils.data.DataLoader(val_set, sampler=sampler_val, batch_size=int(1.5 * args.batch_size),
                                       drop_last=False, **_common(args))




def read_checkpoint(args, path: str):
    """``path`` as :func:`models.checkpoint.read_checkpoint` reads it; with ``--trust-checkpoint``
    also a full checkpoint that ``weights_only=True`` refuses (one warning)."""
    if args.trust_checkpoint and not models.checkpoint.is_safetensors(path):
        log(f"WARNING: --trust-checkpoint: reading {path} with torch.load(weights_only=False), which can run "
            "code stored in the file; only for files you trust")
    return ckpt.read_checkpoint(path, weights_only=not args.trust_checkpoint, trust_remedy=models.checkpoint.TRUST_FLAG_REMEDY)


def _load_weights(args, model):
    """Load ``--resume`` into ``model``; returns the checkpoint object. Quantizer state that does
    not fit the model's groups (the original Mesa's checkpoints) is not loaded, said in one line:
    evaluation does not use it, a resumed training run starts those ranges afresh."""
    obj = read_checkpoint(args, args.resume)
    try:
        report = models.load_checkpoint(model, obj, verbose=lambda *_: None, reset_quantizers=True)
    except models.CheckpointError as exc:
        raise models.CheckpointError(str(exc).replace("<state dict>", args.resume, 1)) from exc
    report.source = args.resume
    reset = report.reset_line("are not used in evaluation" if args.eval else "start afresh")
    report.reset_quantizers = []
    log(report.summary())
    if reset:
        log(reset)
    return obj


def _scale_model(args, num_classes: int) -> None:
    """``--scale-model``: the largest variant whose memory plan fits (rank 0 measures, all take
    its choice); ``args.model_kwargs`` gets its arguments."""
    res, err = None, None
    if get_rank() == 0:  # (an error is shipped to every rank: none waits forever)
        kw = dict(args.model_kwargs or {}, num_classes=num_classes)
        kw.pop("img_size", None)  # (--input-size sets it)
        try:
            res = models.scale.largest_variant(args.model, args.memory_budget_gb * 1e9, args.batch_size,
                                               args.scale_model, input_size=args.input_size, model_kwargs=kw)
            if not res.best["plan"]:
                err = f"--scale-model {args.scale_model}: " + res.table().splitlines()[0] + " none (not even step 1)"
        except (planner.PlanError, ValueError, TypeError, RuntimeError) as exc:
            err = f"--scale-model {args.scale_model}: {exc}"
    res, err = all_gather_object((res, err))[0]
    if err:
        raise UsageError(err)
    log(res.table())
    args.model_kwargs = {**(args.model_kwargs or {}), **res.kwargs("plan")}
    kw = " ".join(f"{k}={v}".replace(" ", "") for k, v in res.kwargs("plan").items())
    log(f"--scale-model {args.scale_model}: {args.model} with {kw} (a --resume of this run needs "
        f"--model-kwargs {kw})")


def _restart_ema(model_ema, model) -> None:
    """The EMA set to the model's current weights."""
    if isinstance(model_ema, fsdp.ShardedModelEma):
        model_ema.reset(model)
    else:
        model_ema.set(model)


def _evaluate_ema(model_ema, model, loader_val, device, args, num_classes: int, n_images: int,
                  summary: bool = True) -> dict:
    """Evaluate the EMA weights (``--model-ema-eval``): ModelEmaV3's copy, or the sharded EMA put
    into the FSDP model for the evaluation. ``summary`` False: no lines (the epoch's line has it)."""
    quiet = args.tqdm or not summary
    if isinstance(model_ema, fsdp.ShardedModelEma):
        with model_ema.applied(model):
            stats = evaluate(loader_val, model, device, args.amp, num_classes, quiet=quiet,
                             print_freq=args.print_freq * 10, summary=summary)
    else:
        stats = evaluate(loader_val, model_ema.module, device, args.amp, num_classes, quiet=quiet,
                         print_freq=args.print_freq * 10, summary=summary)
    if summary:
        log(f"Accuracy of the EMA model on the {n_images} test images: {stats['acc1']:.1f}%")
    return stats


def _evaluate_checkpoint_ema(args, obj, model, loader_val, device, num_classes: int, n_images: int) -> dict:
    """``--eval --model-ema-eval``: the checkpoint's EMA weights (``model_ema``) evaluated too."""
    sharded = fsdp.is_sharded_checkpoint(args.resume)
    if sharded:
        if not fsdp.has_model_ema(args.resume):
            raise UsageError(f"--model-ema-eval: {args.resume} holds no model EMA")
        ema = fsdp.ShardedModelEma(model, 0.0)
        fsdp.load_sharded(args.resume, model, None, ema)  # (the EMA only: the weights are the same)
        sd = ema.state
    else:
        if not (isinstance(obj, dict) and isinstance(obj.get("model_ema"), dict)):
            raise UsageError(f"--model-ema-eval: {args.resume} holds no model EMA ('model_ema')")
        sd = obj["model_ema"]
    ema_model = copy.deepcopy(model)
    models.load_checkpoint(ema_model, sd, verbose=lambda *_: None, reset_quantizers=True)
    stats = evaluate(loader_val, ema_model, device, args.amp, num_classes, use_tqdm=args.tqdm)
    log(f"Accuracy of the EMA model on the {n_images} test images: {stats['acc1']:.1f}%")
    return {f"ema_{k}": v for k, v in stats.items()}


def main(args) -> dict:
    """Run what ``args`` asks; returns the last evaluation / throughput stats (main process)."""
    resolve_args(args)
    dist_info = init_distributed_mode(args.device, args.dist_url)
    try:
        return _run(args, dist_info)
    finally:
        cleanup()


def _run(args, dist_info) -> dict:
    lock = []  # (the output folder's lock, held for the run: closed however it ends)
    try:
        return _run_locked(args, dist_info, lock)
    finally:
        for f in lock:
            f.close()


def _run_locked(args, dist_info, held: list) -> dict:
    device = torch.device(f"cuda:{dist_info.local_rank}" if args.device == "cuda" and dist_info.distributed
                          else args.device)
    args.world_size = dist_info.world_size
    _seed(args.seed + dist_info.rank)
    if args.output_dir and is_main_process():
        os.makedirs(args.output_dir, exist_ok=True)
        if not args.eval and not args.train_throughput:  # (a run writes there: one at a time)
            held += [f for f in (lock_folder(args.output_dir),) if f is not None]
            left = remove_temporaries(args.output_dir)
            if left:
                log(f"removed {len(left)} temporary file(s) of an interrupted write: {', '.join(left)}")
        if args.overwrite and not args.resume and not args.eval and not args.train_throughput:
            removed = _clear_output_dir(args.output_dir, keep=(args.ms_plan, args.ms_policy))
            if removed:
                log(f"--overwrite: deleted {', '.join(removed)} of the previous run in {args.output_dir}")
    barrier()
    log(f"mesa training: {args.model} on {args.data_set}, {dist_info.world_size} process(es), "
        f"device {device}, amp {args.amp}")

    # (the list of skipped images: kept by a training run, the one writer of its folder)
    trains = args.output_dir and not args.eval and not args.train_throughput
    args.skip_log = os.path.join(args.output_dir, "skipped_images.txt") if trains else None
    if args.skip_log and is_main_process() and os.path.exists(args.skip_log) and not args.resume:
        os.unlink(args.skip_log)
    val_set, num_classes = data.build_dataset(False, args)
    if not args.eval:  # evaluation builds no training split
        train_set, _ = data.build_dataset(True, args)
        check_classes(train_set, val_set)

    if getattr(args, "scale_model", None):
        _scale_model(args, num_classes)
    model = build_model(args, num_classes).to(device)
    check_patch_size(model, int(args.input_size), args.model)
    plan_info = None
    if args.memory_budget_gb is not None:
        try:
            mixing = args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None
            _, plan_info, plan_path = memory.plan_for_budget(
                model, args, device, limit=len(train_set) // dist_info.world_size, even=mixing)
        except planner.PlanError as exc:
            raise UsageError(str(exc)) from exc
    elif args.ms_plan or args.ms_policy:  # a plan given as --ms-policy is reported as well
        plan_path = args.ms_plan or args.ms_policy
        plan_info = planner.read_plan(plan_path)
    loader_val = _val_loader(args, dist_info, val_set)
    if not args.eval:
        loader_train, sampler_train = _train_loader(args, dist_info, train_set)
    model_without_ddp = model
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_mesa = sum(1 for _, m in ms.policy.mesa_layers(model) if m.enable)
    n_ckpt = len(planner.checkpointed_blocks(model))
    log(f"model {args.model}: {n_params / 1e6:.2f}M parameters, {n_mesa} Mesa layers enabled"
        + (f", {n_ckpt} blocks checkpointed" if n_ckpt else ""))

    if args.eval:
        if fsdp.is_sharded_checkpoint(args.resume):  # DCP reads it into the unwrapped model, on any ranks
            obj = fsdp.load_sharded(args.resume, model)
            log(f"loaded the sharded checkpoint {args.resume} (epoch {obj.get('epoch')})")
        else:
            obj = _load_weights(args, model)
        stats = evaluate(loader_val, model, device, args.amp, num_classes, use_tqdm=args.tqdm)
        log(f"Accuracy of the network on the {len(val_set)} test images: {stats['acc1']:.1f}%")
        if args.model_ema_eval:
            stats.update(_evaluate_checkpoint_ema(args, obj, model, loader_val, device, num_classes, len(val_set)))
        _report_skipped(args)
        return stats

    model_ema = None
    if args.model_ema and not args.fsdp:
        model_ema = ModelEmaV3(model, decay=args.model_ema_decay,
                               device="cpu" if args.model_ema_force_cpu else None)
    if args.fsdp:
        if not dist_info.distributed:
            raise UsageError("--fsdp needs several processes (torchrun --nproc_per_node N ...)")
        if args.resume and not fsdp.is_sharded_checkpoint(args.resume):  # weights of a file, unsharded
            _load_weights(args, model)
        model = fsdp.wrap(model, device, reshard_after_forward=args.fsdp_reshard_after_forward, amp=args.amp)
        model_without_ddp = model
        if args.model_ema:  # of each rank's shards, from rank 0's weights (as DDP's rank 0 keeps it)
            model_ema = fsdp.ShardedModelEma(model, args.model_ema_decay)
    elif dist_info.distributed:
        # buffers are broadcast from rank 0 only for models with batch norm: Mesa's range
        # buffers are kept equal on all ranks by its own all-reduce (ms.set_dist_sync), and a
        # broadcast into them each step would make every quantizer re-read its iteration count
        # from the device (a host sync per layer: see QuantMixin._draws_for)
        bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
        # (the quantizers' CPU draw counters are equal on all ranks: never broadcast)
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, _ in model.named_buffers() if n.endswith(".draws")])
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[dist_info.local_rank] if device.type == "cuda" else None,
            broadcast_buffers=bn)
        model_without_ddp = model.module

    train_model = model
    if args.compile:
        # (static shapes: a last, smaller batch compiles once more rather than making the batch
        # dim symbolic, which Mesa's SDPA backend choice cannot read at torch 2.8)
        train_model = torch.compile(model, backend=args.compile, dynamic=False)
        log(f"torch.compile (backend {args.compile}): the training step's model; the first step compiles")

    global_batch = args.batch_size * dist_info.world_size
    base_lr = args.lr
    if not args.unscale_lr:
        args.lr = base_lr * global_batch / 512.0
    optimizer, lr_scheduler = build_optimizer(args, model_without_ddp, len(loader_train))
    loss_scaler = make_scaler(args.amp, device)

    mixup_fn = None
    if args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None:
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, cutmix_minmax=args.cutmix_minmax,
                         prob=args.mixup_prob, switch_prob=args.mixup_switch_prob, mode=args.mixup_mode,
                         label_smoothing=args.smoothing, num_classes=num_classes)
        criterion = SoftTargetCrossEntropy()
    elif args.smoothing > 0:
        criterion = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    else:
        criterion = torch.nn.CrossEntropyLoss()

    max_accuracy = 0.0
    rng_to_restore = None
    if args.resume:
        sharded = fsdp.is_sharded_checkpoint(args.resume)
        if sharded:  # model, optimizer and EMA in place, whatever the wrapping and number of ranks
            sharded_ema = model_ema if isinstance(model_ema, fsdp.ShardedModelEma) else None
            obj = fsdp.load_sharded(args.resume, model_without_ddp, None if args.eval else optimizer, sharded_ema)
            log(f"loaded the sharded checkpoint {args.resume} (epoch {obj.get('epoch')})")
        elif args.fsdp:
            obj = {}  # (--eval) the weights were loaded before sharding
        else:
            obj = _load_weights(args, model_without_ddp)
        ema_loaded = False
        if not args.eval and isinstance(obj, dict) and (sharded or "optimizer" in obj) and "epoch" in obj:
            if not sharded:
                optimizer.load_state_dict(obj["optimizer"])
            lr_scheduler.load_state_dict(obj["lr_scheduler"])
            loss_scaler.load_state_dict(obj.get("scaler", {}))
            if isinstance(model_ema, ModelEmaV3) and "model_ema" in obj:
                # (as the weights: quantizer state of other group counts starts afresh)
                models.load_checkpoint(model_ema.module, obj["model_ema"], verbose=lambda *_: None,
                                       reset_quantizers=True)
            ema_loaded = bool(obj.get("model_ema_loaded")) if sharded else "model_ema" in obj
            args.start_epoch = int(obj["epoch"]) + 1
            max_accuracy = float(obj.get("max_accuracy", 0.0))
            rng = obj.get("rng") or []
            if len(rng) == dist_info.world_size:
                rng_to_restore = rng[dist_info.rank]
            else:
                log(f"resume: the checkpoint holds RNG states of {len(rng)} ranks, this run has "
                    f"{dist_info.world_size}: random streams restart from --seed")
            log(f"resumed from {args.resume} at epoch {args.start_epoch}")
        if model_ema is not None and not ema_loaded:  # not the initial weights the EMA was made of
            _restart_ema(model_ema, model_without_ddp)
            log(f"model EMA: none taken from {args.resume} (it holds none, or weights only to start from); "
                "it starts from the loaded weights")

    if args.train_throughput:
        return train_throughput(train_model, criterion, loader_train, optimizer, device, loss_scaler, args.amp,
                                mixup_fn)

    args_dict = args_to_dict(args)
    save_args(args_dict, args.output_dir)
    tb = TensorBoard(None if args.no_tensorboard or not args.output_dir else args.output_dir)
    jlog = JsonLog(args.output_dir)
    if rng_to_restore is not None:
        ckpt.set_rng_states(rng_to_restore)
    log(f"Start training for {args.epochs} epochs (lr {lr_line(args.lr, base_lr, global_batch, args.unscale_lr)})")
    start = time.time()
    stats = {}
    last = args.epochs if args.stop_after is None else min(args.epochs, args.start_epoch + args.stop_after)
    for epoch in range(args.start_epoch, last):
        sampler_train.set_epoch(epoch)
        train_stats = train_one_epoch(
            train_model, criterion, loader_train, optimizer, device, epoch, loss_scaler, args.amp,
            max_norm=args.clip_grad, model_ema=model_ema, mixup_fn=mixup_fn, print_freq=args.print_freq,
            use_tqdm=args.tqdm, tb=tb, global_step=epoch * len(loader_train), meter_model=model_without_ddp,
            lr_scheduler=lr_scheduler if args.sched_on_updates else None,
            on_first_step=memory.first_step_report(plan_info, args.batch_size, plan_path)
            if plan_info and epoch == args.start_epoch else None, quiet=args.epoch_lines,
            compiled=bool(args.compile), compile_step=bool(args.compile) and epoch == args.start_epoch)
        if "compile_s" in train_stats:
            log(f"torch.compile: the first step took {train_stats['compile_s']:.1f} s (compiling; not in the "
                "step time)")
        lr_scheduler.step(epoch + 1)
        test_stats = evaluate(loader_val, model_without_ddp, device, args.amp, num_classes,
                              print_freq=args.print_freq * 10, quiet=args.tqdm or args.epoch_lines,
                              summary=not args.epoch_lines, where=f"epoch {epoch}")
        if model_ema is not None and args.model_ema_eval:
            ema_stats = _evaluate_ema(model_ema, model_without_ddp, loader_val, device, args, num_classes,
                                      len(val_set), summary=not args.epoch_lines)
            test_stats.update({f"ema_{k}": v for k, v in ema_stats.items()})
        best = test_stats["acc1"] > max_accuracy
        max_accuracy = max(max_accuracy, test_stats["acc1"])
        if args.epoch_lines:
            log(f"Epoch {epoch + 1}/{args.epochs}: loss {train_stats['loss']:.4f}  lr {train_stats['lr']:.6f}  "
                f"step {train_stats['step_ms']:.1f} ms  saved activations {train_stats['saved_act_mib']:.2f} MiB  "
                f"top-1 {test_stats['acc1']:.1f}% (best {max_accuracy:.1f}%)"
                + (f"  EMA top-1 {test_stats['ema_acc1']:.1f}%" if "ema_acc1" in test_stats else ""))
        elif not args.tqdm:
            log(f"Accuracy of the network on the {len(val_set)} test images: {test_stats['acc1']:.1f}%")
            log(f"Max accuracy: {max_accuracy:.2f}%")
        rng = all_gather_object(ckpt.get_rng_states())
        if args.output_dir and args.fsdp:  # every rank writes its shards
            extra = {"lr_scheduler": lr_scheduler.state_dict(), "scaler": loss_scaler.state_dict(),
                     "epoch": int(epoch), "max_accuracy": float(max_accuracy), "args": args_dict, "rng": rng,
                     "meta": ckpt._meta(model_without_ddp)}
            # (the best first: the checkpoint that records the new best accuracy never precedes it)
            for name in (("best_checkpoint",) if best else ()) + ("checkpoint",):
                fsdp.save_sharded(os.path.join(args.output_dir, name), model, optimizer, extra, model_ema)
        elif args.output_dir and is_main_process():
            obj = ckpt.build_checkpoint(model_without_ddp, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                        scaler=loss_scaler, model_ema=model_ema, epoch=epoch,
                                        max_accuracy=max_accuracy, args=args_dict, rng=rng)
            if best:  # (first: a kill between the two never leaves a record of a best that is lost)
                ckpt.atomic_save(obj, os.path.join(args.output_dir, "best_checkpoint.pth"))
            ckpt.atomic_save(obj, os.path.join(args.output_dir, "checkpoint.pth"))
        stats = {**{f"train_{k}": v for k, v in train_stats.items()},
                 **{f"test_{k}": v for k, v in test_stats.items()},
                 "epoch": epoch, "n_parameters": n_params, "max_accuracy": max_accuracy}
        jlog.write(stats)
        tb.scalars({"loss": train_stats["loss"], "lr": train_stats["lr"], "img_per_s": train_stats["img/s"],
                    "step_ms": train_stats["step_ms"], "max_mem_mb": train_stats["max_mem_mb"],
                    "saved_act_mib": train_stats["saved_act_mib"]}, epoch, prefix="train/")
        tb.scalars({"acc1": test_stats["acc1"], "acc5": test_stats["acc5"], "loss": test_stats["loss"]},
                   epoch, prefix="test/")
    tb.close()
    if args.fsdp and args.output_dir:  # the whole model, for --eval and models.load_checkpoint
        full = {"model": fsdp.full_model_state_dict(model, rank0_only=True), "meta": ckpt._meta(model_without_ddp),
                "epoch": last - 1}
        if model_ema is not None:
            full["model_ema"] = model_ema.full_state_dict(rank0_only=True)
        if is_main_process():
            ckpt.atomic_save(full, os.path.join(args.output_dir, "checkpoint_full.pth"))
    if args.save_rank_state and args.output_dir:
        barrier()
        state = fsdp.full_model_state_dict(model) if args.fsdp else model_without_ddp.state_dict()
        state = models.checkpoint.add_checksum({"model": state, "rank": get_rank()})
        ckpt.atomic_save(state, os.path.join(args.output_dir, f"rank{get_rank()}_state.pth"))
    log(f"Training time {datetime.timedelta(seconds=int(time.time() - start))}")
    _report_skipped(args)
    return stats


def _report_skipped(args) -> None:
    skipped = data.images.read_skipped(args.skip_log)
    if skipped and is_main_process():
        log(f"skipped {len(skipped)} unreadable image(s) (listed in {args.skip_log}), first: {skipped[0]}")
