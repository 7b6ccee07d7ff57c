"""TRL 1.16.0's real `GRPOTrainer` on CPU, with shoal's environment factory: one training step on two
generated tasks. The model is a tiny Qwen3 built here with random weights (nothing is downloaded from a
hub); its tokenizer is built here too, with the Qwen3 chat template TRL ships in its package (so TRL's
tool-calling support finds its response parser). A random model rarely calls a tool: what this proves is
the wiring — TRL constructs the envs, resets one per rollout (a sandbox each), renders their tools into the
prompt, asks each for its reward (graded), and trains on it. `make test-trainers` runs it (torch and TRL
are not part of `make test`)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="make test-trainers installs torch (CPU) and TRL")
trl = pytest.importorskip("trl", reason="make test-trainers installs torch (CPU) and TRL")
pytestmark = [pytest.mark.root, pytest.mark.slow]


def tiny_qwen3(tmp: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
                "<tool_response>", "</tool_response>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t", "…", "—", "→", "·"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="?", additional_special_tokens=specials[3:], chat_template=template)
    tok.padding_side = "left"
    cfg = Qwen3Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=8192,
                      eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"])
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg), tok


def test_grpo_trainer_runs_shoal_environments(shoal_home, base_image, rl_tasks: list, tmp_path: Path) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from shoal.integrations.trl import ShoalToolEnv
    from shoal.sdk.sync import close_shared_client

    resets: list[str] = []
    rewards: list[float] = []

    class Env(ShoalToolEnv):
        tasks = rl_tasks
        max_steps = 4

        def reset(self, **row):
            resets.append(row["instance_id"])
            return super().reset(**row)

        def get_reward(self) -> float:
            r = super().get_reward()
            rewards.append(r)
            return r

    model, tok = tiny_qwen3(tmp_path)
    rows = [{"prompt": [{"role": "user", "content": "Fix the failing test."}], "instance_id": t.instance_id}
            for t in rl_tasks]
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2,
                      num_generations=2, max_completion_length=24, learning_rate=1e-4, logging_steps=1,
                      report_to="none", use_cpu=True, save_strategy="no", bf16=False, seed=0)
    try:
        trainer = GRPOTrainer(model=model, processing_class=tok, args=args, train_dataset=Dataset.from_list(rows),
                              environment_factory=Env)
        trainer.train()
    finally:
        close_shared_client()
    assert len(resets) == 2 and set(resets) <= {t.instance_id for t in rl_tasks}
    assert len(rewards) == 2 and all(r in (0.0, 1.0) for r in rewards)
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert logged and "rewards/Env/mean" in logged[0], logged
