"""The recipe's keys: one dataclass per section, each key with its type (Literal for a choice), default, help and
minimum. Validation (recipe/), `lcsb validate --explain` and the shipped recipes' comments all read them here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..selective.choices import IDLE_UPDATES, LR_SCALES, ON_RETURN, SCHEDULES, UPPER_PATHS

# lora.targets' default: peft's rule, every linear layer but the LM head (Qwen2, Llama, Gemma 3: q/k/v/o_proj and
# gate/up/down_proj; Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj)
ALL_LINEAR = "all-linear"
# data/formats.py implements each (a test checks)
FORMATS = ("lamp2", "jsonl", "text", "completion", "chat", "preference", "feedback")
# objectives/ implements each: the loss, orthogonal to the method
OBJECTIVES = ("sft", "dpo", "orpo", "kto")
# methods.py implements each (a test checks)
METHODS = ("lcsb", "full-backprop", "freeze", "lisa", "mezo")
LABELLED, LM = ("lamp2", "jsonl"), ("jsonl", "text", "completion", "chat", "preference", "feedback")


def key(
    default,
    help: str,
    *,
    min: float | None = None,
    formats: tuple[str, ...] | None = None,
    factory=None,
):
    """A recipe key: its default, its help (`lcsb validate --explain`, the shipped recipes' comments), its minimum
    and, for a data key, the formats that read it (setting it for another format is an error)."""
    metadata = {"help": help, "min": min, "formats": formats}
    return field(default_factory=factory, metadata=metadata) if factory else field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    name: str = key(
        "tiny-qwen2",
        "a built-in preset (configs/models/NAME.yaml), a local HF checkpoint dir or a "
        ".gguf file (converted once, cached)",
    )
    dtype: Literal["float32", "bfloat16"] = key("float32", "storage of the frozen weights")
    trust_remote_code: bool = key(False, "run Python code shipped with the checkpoint (off: a warning says so when on)")


@dataclass
class LoraConfig:
    rank: int = key(16, "LoRA rank r", min=1)
    alpha: float = key(32.0, "LoRA scaling alpha (the update is scaled by alpha / r)")
    dropout: float = key(0.0, "dropout on the LoRA input", min=0.0)
    targets: list[str] = key(
        None,
        "the linear layers that get adapters: all-linear (every one but the LM head) or their names, e.g. "
        "[q_proj, v_proj]",
        factory=lambda: [ALL_LINEAR],
    )
    backward: Literal["autograd", "mesp"] = key(
        "autograd", "autograd: peft's layers | mesp: saves only x and recomputes xA in backward"
    )
    init: str | None = key(
        None,
        "warm start: train on from this adapter (a run dir, a PEFT adapter dir, adapters/ID of a per-user run, or an "
        "adapter GGUF lcsb exported) with a fresh optimizer and LR schedule; its base, rank, alpha and targets must be "
        "this recipe's",
    )
    init_user: str | None = key(
        None, "the user whose adapter a per-user run in lora.init gives (default: data.user when it names one)"
    )
    init_sha256: str | None = key(
        None,
        "the starting adapter's hash, which lcsb writes into config.yaml when the run starts; set it to pin lora.init "
        "(another adapter there is refused)",
    )


@dataclass
class LcsbExperimental:
    """Dials the study measured losing, or never measured (docs/RESULTS.md): for experiments/ only."""

    schedule: Literal[SCHEDULES] = key(
        "cyclic",
        "which block trains: cyclic (t mod K) | reverse | random (a fresh "
        "permutation each cycle) | adaptive (largest recent gradient, weighted by wait)",
    )
    exact_above: int = key(0, "identity path: layers just above the active block that backpropagate exactly", min=0)
    idle_update: Literal[IDLE_UPDATES] = key(
        "momentum", "idle blocks: momentum (step on their stored AdamW moments, the paper) | none"
    )
    lr_scale: Literal[LR_SCALES] = key(
        "none",
        "rate per block times none | sqrt_k (1/sqrt of its share of steps with a gradient: what idle momentum "
        "loses) | k (1/share: what idle_update none loses)",
    )
    switch_every: int = key(1, "steps a block stays active before the schedule moves on (BAdam, HiFT)", min=1)
    on_return: Literal[ON_RETURN] = key(
        "keep", "a block that becomes active again: keep its AdamW moments | reset them (BAdam)"
    )


# the lcsb keys that moved into lcsb.experimental (issue 49): a recipe that sets one gets a line naming the new place
MOVED_KEYS = {f"lcsb.{name}": f"lcsb.experimental.{name}" for name in LcsbExperimental.__dataclass_fields__}


@dataclass
class LcsbConfig:
    blocks: int = key(4, "K: the decoder layers split into K contiguous blocks, one trained per step", min=1)
    upper_path: Literal[UPPER_PATHS] = key(
        "suffix",
        "layers above the active block: suffix (exact, and their LoRA trains too: the study's best on every task) | "
        "exact (true gradient, their LoRA frozen) | identity (the paper's surrogate)",
    )
    experimental: LcsbExperimental = key(
        None, "dials the study measured losing or never measured (experiments/)", factory=LcsbExperimental
    )


@dataclass
class NpuSimConfig:
    device: str = key("snapdragon-8gen3", "a profile in configs/devices/ or a path to a profile YAML")
    weights: Literal["fp16", "int8", "int4"] = key(
        "int8", "the NPU's resident weights: fp16 | int8 (per channel) | int4 (groups of 32)"
    )
    precision: Literal["auto", "fp16", "fp32", "w8a16", "w8a8"] = key(
        "auto", "product precision: auto (per layer by calibrated input-gradient error) | fp16 | fp32 | w8a16 | w8a8"
    )
    row_protection: bool = key(True, "per-row power-of-two scaling around every FP16 cast")
    overlap: bool = key(True, "NPU products on a worker thread while the CPU computes the adapters")
    fuse_cpu_ops: bool = key(
        True, "the CPU lane's elementwise chains (norms, RoPE, softmax, SiLU x up) as fused kernels"
    )
    calibration_steps: int = key(
        4, "precision=auto: steps measuring each layer's fp16 input-gradient error (>= K covers every block)", min=1
    )
    fp32_threshold: float = key(
        0.01, "precision=auto: relative error above which a layer moves to a more precise precision", min=0.0
    )


# data.columns: the roles whose column a text, completion or chat recipe can name (data/columns.py reads them)
COLUMN_ROLES = {
    "text": ("id", "text"),
    "completion": ("id", "prompt", "completion"),
    "chat": ("id", "messages"),
    "preference": ("id", "prompt", "chosen", "rejected"),
    "feedback": ("id", "prompt", "completion", "label"),
}


@dataclass
class DataConfig:
    format: Literal[FORMATS] = key(
        "lamp2",
        "lamp2: LaMP-2 JSON; jsonl: phone labels; text, completion, chat: see data/lm.py; preference "
        "{prompt, chosen, rejected}, feedback {prompt, completion, label}: see data/preference.py",
    )
    train: str | None = key(None, "the training file (text, completion, chat: or a datasets save_to_disk directory)")
    train_labels: str | None = key(None, "LaMP-2: the *_outputs.json of data.train", formats=("lamp2",))
    eval: str | None = key(None, "the held-out file")
    eval_labels: str | None = key(None, "LaMP-2: the *_outputs.json of data.eval", formats=("lamp2",))
    max_length: int = key(256, "tokens per example at most", min=16)
    pad_to_multiple_of: int = key(
        32, "a training batch pads to its longest row rounded up to this (mlx-lm's 32); 1: the longest row", min=1
    )
    packing: bool = key(
        False,
        "concatenate examples into rows of max_length tokens; positions restart and attention stays inside each one",
        formats=("text", "completion", "chat"),
    )
    profile_k: int = key(
        0, "LaMP-2: prepend the k most relevant profile items (BM25) to each question", min=0, formats=("lamp2",)
    )
    user: str | None = key(
        None, "train/evaluate one user's adapter (a user id); LaMP-2 also all (one adapter per user)", formats=LABELLED
    )
    eval_fraction: float = key(
        0.2, "held out without data.eval: jsonl the newest items, text/completion/chat a seeded draw", formats=LM
    )
    on_bad_line: Literal["error", "skip"] = key(
        "error", "a bad line: error (stop, naming the line) | skip (count it)", formats=LM
    )
    labels: list[str] | None = key(None, "jsonl: the label set; null infers it from the data", formats=("jsonl",))
    columns: dict | None = key(
        None,
        "the column of each role where yours are named otherwise, e.g. {prompt: question, completion: answer}; "
        "roles: text, prompt, completion, messages (by format) and id",
        formats=("text", "completion", "chat"),
    )


@dataclass
class PreferenceConfig:
    """The preference objectives' keys (objectives/losses.py), named and defaulted as TRL names them."""

    beta: float = key(
        0.1, "dpo, kto: the implicit reward's scale, beta * (log pi - log pi_ref); lower strays further from the base"
    )
    orpo_lambda: float = key(0.1, "orpo: the weight of the log-odds-ratio term beside the chosen NLL (TRL's beta)")
    label_smoothing: float = key(
        0.0, "dpo: the share of pairs assumed flipped (conservative DPO): -(1-e) log s(bz) - e log s(-bz)", min=0.0
    )
    desirable_weight: float = key(1.0, "kto: the weight of the desirable (label true) examples' losses", min=0.0)
    undesirable_weight: float = key(1.0, "kto: the weight of the undesirable (label false) examples' losses", min=0.0)


@dataclass
class OvernightConfig:
    window: str | None = key(None, '"HH:MM-HH:MM": wait for the start, stop (checkpointed) at the end')
    max_minutes: float = key(0.0, "stop (checkpointed) after this many minutes of this process; 0: no limit", min=0.0)
    max_temp_c: float = key(0.0, "pause while the device is hotter than this; 0: never", min=0.0)
    report: bool = key(False, "eval before and after training, report.md + report.json in the run dir")


@dataclass
class LineageConfig:
    replay: float = key(
        0.5,
        "`lcsb night`: the share of a night's training items replayed from earlier nights (a sample seeded by "
        "train.seed and the night)",
        min=0.0,
    )
    tolerance: float = key(
        0.0,
        "`lcsb night`: what a night may lose on the held-out newest items or the probe and still be promoted: "
        "accuracy, or nats of held-out loss for chat, completion and text",
        min=0.0,
    )
    probe: int = key(8, "`lcsb night`: the earliest items learned, kept as the fixed probe for forgetting", min=1)
    passes: float = key(
        0.0,
        "`lcsb night`: a night's length in passes over its training items (new, carried and replayed): "
        "ceil(passes x items / (batch_size x grad_accum)) steps; 0: train.max_steps every night",
        min=0.0,
    )


@dataclass
class TrainConfig:
    max_steps: int = key(200, "optimizer steps", min=1)
    batch_size: int = key(4, "examples per micro-batch", min=1)
    grad_accum: int = key(1, "micro-batches per optimizer step", min=1)
    lr: float = key(1e-4, "peak learning rate of the gradient methods")
    weight_decay: float = key(0.01, "AdamW's decoupled weight decay", min=0.0)
    warmup_steps: int = key(10, "steps of linear warmup", min=0)
    lr_scheduler: Literal["cosine", "linear", "constant"] = key("cosine", "after warmup: cosine | linear | constant")
    max_grad_norm: float = key(1.0, "gradient clipping norm; 0 disables clipping", min=0.0)
    seed: int = key(0, "seeds the LoRA init, the data order and the methods' draws")
    log_every: int = key(1, "a metrics.jsonl row every N steps", min=1)
    save_every: int = key(50, "a checkpoint every N steps; 0: only at the end", min=0)
    eval_every: int = key(0, "held-out metrics (eval_loss, eval_accuracy, ...) every N steps; 0: never", min=0)
    eval_metrics: Literal["all", "loss"] = key(
        "all", "eval_every rows: all the task's metrics | loss only (no scoring or decoding; the last row has all)"
    )
    autocast: Literal["none", "bf16", "auto"] = key(
        "auto",
        "auto (bf16 on cuda and on CPUs with native bf16, none where bf16 is emulated) | none | bf16 (frozen weights "
        "stored and multiplied in bf16, LoRA and optimizer in fp32)",
    )
    threads: int = key(0, "torch intra-op threads; 0 keeps torch's default", min=0)
    optimizer: Literal["adamw", "adamw8bit"] = key(
        "adamw", "adamw (torch, fp32 moments) | adamw8bit (bitsandbytes, block-wise 8-bit moments)"
    )
    report_to: list[str] = key(
        None,
        "trackers fed the metrics.jsonl rows (offline by default): tensorboard | wandb | mlflow | trackio",
        factory=list,
    )
    keep_best: bool = key(
        False, "with eval_every: adapter/ holds the adapter of the lowest held-out loss, adapter-last/ the last one"
    )
    early_stopping_patience: int = key(
        0, "with eval_every: stop after N evaluations without an improvement of min_delta; 0: never", min=0
    )
    early_stopping_min_delta: float = key(0.0, "the held-out loss drop that counts as an improvement", min=0.0)
    check_initial_loss: bool = key(
        True,
        "stop a fresh run whose loss on its first batch (every token) is above ln(vocab_size) + 1, worse than "
        "a uniform guess, and say why: a base that does not know the text (lamp-tiny on your data) or a broken model",
    )


@dataclass
class FreezeConfig:
    layers: int = key(6, "LoRA trains on the top this many layers only", min=1)


@dataclass
class LisaConfig:
    layers: int = key(2, "layers trained at a time", min=1)
    interval: int = key(20, "steps between fresh random draws", min=1)


@dataclass
class MezoConfig:
    eps: float = key(1e-3, "SPSA perturbation scale")
    lr: float = key(1e-6, "MeZO's own learning rate (train.lr is for the gradient methods)")


@dataclass
class DivergenceConfig:
    action: Literal["stop", "skip", "rollback"] = key(
        "rollback", "on a non-finite or spiking loss: stop (exit 3) | skip the update | rollback + lr backoff"
    )
    spike_factor: float = key(4.0, "a loss above this x the running median of recent losses is a spike", min=1.0)
    patience: int = key(3, "spikes in a row that count as divergence (a non-finite loss counts at once)", min=1)
    lr_backoff: float = key(0.5, "rollback multiplies the learning rate by this, in (0, 1]", min=0.0)
    climb_nats: float = key(
        1.0,
        "a slow climb: the mean loss of the last climb_window steps this many nats above its lowest so far diverges "
        "(the action returns to the state at that lowest mean); 0: off",
        min=0.0,
    )
    climb_window: int = key(10, "steps whose mean loss the climb test compares", min=2)
    snapshot: Literal["memory", "disk", "none"] = key(
        "memory", "the state a divergence returns to: memory | disk (run_dir/snapshot/) | none (stop only)"
    )


@dataclass
class EvalConfig:
    mode: Literal["score", "generate"] = key(
        "score", "score: rank the tags by likelihood | generate: greedy decoding, exact match"
    )
    batch_size: int = key(8, "questions per forward pass", min=1)
    max_new_tokens: int = key(8, "generate mode: new tokens at most", min=1)
    stop: list[str] = key(None, 'generated answers end before the first of these ("\\n": one line)', factory=list)


@dataclass
class MemoryConfig:
    streamed_load: bool = key(False, "build on the meta device, quantize one module at a time (quantization nf4 | fp4)")
    embedding: Literal["keep", "nf4", "fp4"] = key(
        "keep", "the embedding and LM head: keep (model.dtype) | nf4 | fp4 (streamed_load only)"
    )
    malloc_mmap_threshold_kb: int = key(
        0, "glibc: blocks above this are mmapped and returned when freed; 0: default", min=0
    )
    kernel_cache: int = key(
        32, "oneDNN / ideep kernels cached (one per matmul shape: each new batch length adds); 0: theirs, 1024", min=0
    )


@dataclass
class Recipe:
    name: str = key("run", "the run's name (output_dir defaults to runs/NAME)")
    model: ModelConfig = key(None, "the base model", factory=ModelConfig)
    quantization: Literal["none", "int8", "nf4", "fp4", "gguf"] = key(
        "none",
        "the frozen weights: bitsandbytes' int8 or 4-bit formats, gguf (a .gguf base's own blocks, dequantized per "
        "product), or none",
    )
    lora: LoraConfig = key(None, "the adapters", factory=LoraConfig)
    method: Literal[METHODS] = key("lcsb", "the training method (lcsb_cli/methods.py)")
    objective: Literal[OBJECTIVES] = key(
        "sft",
        "the loss, whatever the method: sft (cross-entropy on the targets) | dpo | orpo (data.format preference) | "
        "kto (data.format feedback); lcsb_cli/objectives/",
    )
    preference: PreferenceConfig = key(None, "the preference objectives' keys", factory=PreferenceConfig)
    lcsb: LcsbConfig = key(None, "layer-cyclic selective backprop", factory=LcsbConfig)
    activation_checkpointing: bool = key(
        False, "recompute layers in backward (under lcsb: the active block, and the exact or suffix layers above it)"
    )
    backend: Literal["cpu", "cuda", "npu-sim", "npu-htp"] = key(
        "cpu", "where a step runs; npu-sim: a simulated phone NPU, npu-htp: Qualcomm's HTP kernels"
    )
    npu_sim: NpuSimConfig = key(None, "the NPU backends", factory=NpuSimConfig)
    data: DataConfig = key(None, "the data", factory=DataConfig)
    train: TrainConfig = key(None, "the training loop", factory=TrainConfig)
    freeze: FreezeConfig = key(None, "method freeze", factory=FreezeConfig)
    lisa: LisaConfig = key(None, "method lisa", factory=LisaConfig)
    mezo: MezoConfig = key(None, "method mezo", factory=MezoConfig)
    divergence: DivergenceConfig = key(None, "what a diverging run does", factory=DivergenceConfig)
    eval: EvalConfig = key(None, "held-out evaluation", factory=EvalConfig)
    overnight: OvernightConfig = key(None, "background jobs", factory=OvernightConfig)
    lineage: LineageConfig = key(None, "`lcsb night`: nights that build on each other", factory=LineageConfig)
    memory: MemoryConfig = key(None, "memory settings", factory=MemoryConfig)
    output_dir: str | None = key(None, "the run directory; default: runs/NAME")
