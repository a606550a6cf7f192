"""The peer harness's shared pieces (bench/peers/): what every system is given must really be the
same, and the table must print what the runs measured. The runs themselves need a GPU and the
peers' wheels (bench/peers/README.md); `rollout.min_new_tokens`, which the harness relies on, is
checked here through a real episode loop."""

from __future__ import annotations

import itertools
import json
import types

import anyio
import gymnasium
import pytest
from transformers import AutoTokenizer

from agentrl.rollout.chat import ChatRenderer
from agentrl.config import RolloutConfig, load_config
from agentrl.engine.vllm_engine import GenerationResult
from agentrl.rollout.episode import run_episode
from bench.peers.common import (
    WORKLOADS,
    observation_text,
    prompt_texts,
    reply_reward,
    workload,
)
from bench.peers.table import table


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("name", [*WORKLOADS, "long32k"])
def test_prompts_and_tool_answers_have_the_workloads_token_counts(tok, name):
    wl = workload(name)
    prompts = prompt_texts(tok, wl, 16)
    assert len(set(prompts)) == 16 and prompts == prompt_texts(tok, wl, 16)  # distinct, and the same every run
    for p in prompts:  # never longer than asked, and within a word or two of it
        assert wl.prompt_tokens - 8 <= len(tok(p, add_special_tokens=False)["input_ids"]) <= wl.prompt_tokens
    obs = observation_text(tok, wl)
    n = len(tok(obs, add_special_tokens=False)["input_ids"])
    assert (n == 0) if not wl.obs_tokens else (wl.obs_tokens - 8 <= n <= wl.obs_tokens)


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 700])
def test_texts_are_the_word_by_word_ones(tok, num_tokens):
    """The bisecting text builder gives the text (and leaves the generator where) a word-by-word loop
    would: the longest run of drawn words within the count; the next text goes on after one word more."""
    import random

    from bench.peers.common import _WORDS, _text_of_tokens

    def word_by_word(rng):
        text = ""
        while True:
            longer = (text + " " if text else "") + rng.choice(_WORDS)
            if len(tok(longer, add_special_tokens=False)["input_ids"]) > num_tokens:
                return text
            text = longer

    slow, fast = random.Random(num_tokens), random.Random(num_tokens)
    for _ in range(3):  # three texts in a row from one generator, as prompt_texts draws them
        assert _text_of_tokens(tok, fast, num_tokens, _WORDS) == word_by_word(slow)
    assert fast.random() == slow.random()
    def no_ids(text, add_special_tokens=False):
        return {"input_ids": []}

    with pytest.raises(ValueError, match="come to <= 5 tokens"):  # words of no tokens: an error, not a hang
        _text_of_tokens(no_ids, random.Random(0), 5, _WORDS)


def test_long_workload_is_about_16k_tokens():
    assert 15_500 <= WORKLOADS["long"].episode_tokens <= 16_800


@pytest.mark.parametrize("k", [4, 16, 24, 32, 64, 384, 512])
def test_longNk_workloads_reach_their_length_with_longer_tool_answers(k):
    """Where each system stops fitting: the long workload with only its tool answers grown."""
    import dataclasses

    wl, base = workload(f"long{k}k"), WORKLOADS["long"]
    assert k * 1024 - base.tool_calls <= wl.episode_tokens <= k * 1024
    assert wl.name == f"long{k}k" and wl.obs_tokens > 0
    same = {f.name for f in dataclasses.fields(wl)} - {"name", "obs_tokens"}
    assert all(getattr(wl, f) == getattr(base, f) for f in same)


@pytest.mark.parametrize("bad", ["long", "long2k", "long513k", "long16", "short", "long-4k"])
def test_unknown_workloads_are_refused_by_the_runners_parser(bad, capsys):
    from bench.peers.common import harness_parser

    if bad == "long":  # a name of WORKLOADS itself
        assert harness_parser("x").parse_args(["--workload", bad]).workload == "long"
        return
    with pytest.raises(SystemExit):
        harness_parser("x").parse_args(["--workload", bad])
    assert "unknown workload" in capsys.readouterr().err


def test_reply_reward_counts_decoded_text_per_token():
    assert reply_reward([], 8) == 0.0
    assert reply_reward(["", "   "], 8) == 0.0
    assert reply_reward(["abcd" * 4], 8) == pytest.approx(0.5)  # 16 chars / (4 * 8)
    assert reply_reward(["x" * 1000, ""], 8) == pytest.approx(0.5)  # capped at 1 per reply, then averaged


def test_peer_env_ends_after_its_tool_calls_with_the_shared_reward(tmp_path, tok):
    import bench.peers.peer_env  # noqa: F401  (registers PeerTool-v0)

    wl = WORKLOADS["multi"].scaled(0.1)
    texts = tmp_path / "t.json"
    texts.write_text(json.dumps({"prompts": prompt_texts(tok, wl, 4), "observation": "red green"}))
    env = gymnasium.make("PeerTool-v0", texts_file=str(texts), tool_calls=3, latency_s=0.0, new_tokens=4, max_turns=4)
    obs, _ = env.reset(seed=0)
    assert obs[0]["role"] == "user"
    for _ in range(3):
        obs, reward, terminated, truncated, info = env.step("some reply")
        assert obs == [{"role": "tool", "content": "red green"}] and not terminated and info["num_tool_calls"] == 1
    _, reward, terminated, _, _ = env.step("")
    assert terminated and reward == pytest.approx(reply_reward(["some reply"] * 3 + [""], 4))
    from gymnasium.utils.env_checker import check_env

    check_env(env.unwrapped, skip_render_check=True)


class _Recorder:
    def __init__(self, renderer):
        self.renderer, self.calls = renderer, []

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id, **kw):
        self.calls.append(dict(max_tokens=max_tokens, **kw))
        ids = self.renderer.encode("hello")[:max_tokens]
        return GenerationResult(ids, [-0.1] * len(ids), [0] * len(ids), "length")


@pytest.mark.parametrize("min_new", [0, 6, 500])
def test_min_new_tokens_reaches_the_engine_and_never_exceeds_the_turns_budget(tok, min_new):
    import bench.peers.peer_env  # noqa: F401

    renderer = ChatRenderer(tok)
    client = _Recorder(renderer)
    from agentrl.envs.calculator import CalculatorEnv

    # the class itself, not gymnasium's registry: test_docs removes the ids its doc blocks register,
    # which are agentrl's own when that file runs first
    env = CalculatorEnv()
    cfg = RolloutConfig(max_new_tokens=12, min_new_tokens=min_new, max_turns=2, max_total_tokens=4096)
    anyio.run(lambda: run_episode(env, renderer, client, seed=0, cfg=cfg, episode_id="e"))
    assert client.calls
    for call in client.calls:
        assert call.get("min_tokens", 0) == min(min_new, call["max_tokens"])
        assert ("min_tokens" in call) == bool(min_new)  # engines without the keyword keep working at 0


def test_min_new_tokens_is_a_config_field_that_refuses_negatives():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert load_config(root / "configs" / "quickstart.yaml", ["rollout.min_new_tokens=5"]).rollout.min_new_tokens == 5
    with pytest.raises(Exception, match="min_new_tokens"):
        load_config(root / "configs" / "quickstart.yaml", ["rollout.min_new_tokens=-1"])


def test_peer_env_reward_drops_special_token_texts_as_the_peers_decoding_does(tmp_path, tok):
    """verl's and TRL's rewards decode replies with skip_special_tokens=True; agentrl's env gets the
    text with them kept, so the env drops the special tokens' texts before scoring."""
    from bench.peers.peer_env import PeerToolEnv

    texts = tmp_path / "t.json"
    texts.write_text(json.dumps({"prompts": ["p"], "observation": "o", "special_tokens": list(tok.all_special_tokens)}))
    env = PeerToolEnv(texts_file=str(texts), tool_calls=0, latency_s=0.0, new_tokens=4)
    ids = tok("red green", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<tool_call>")]
    kept = tok.decode(ids, skip_special_tokens=False)
    assert "<tool_call>" in kept
    env.reset(seed=0)
    _, reward, terminated, _, _ = env.step(kept)
    assert terminated and reward == pytest.approx(reply_reward([tok.decode(ids, skip_special_tokens=True)], 4))


def test_agentrl_runner_samples_the_tokenizers_ids_as_verl_does(tmp_path):
    """run_agentrl's overrides load on configs/gpu_1x.yaml with model.tokenizer_vocab_only on."""
    from pathlib import Path

    from bench.peers import run_agentrl
    from bench.peers.common import harness_parser

    root = Path(__file__).resolve().parents[1]
    args = harness_parser(run_agentrl.__doc__).parse_args(["--workload", "multi", "--workdir", str(tmp_path)])
    args.cpu, args.engine_mem, args.set = False, 0.2, []
    for setting in ("recommended", "like", "memory"):
        ovr = run_agentrl.overrides(args, WORKLOADS["multi"], str(tmp_path / "model"), str(tmp_path / "t.json"), setting)
        cfg = load_config(root / "configs" / "gpu_1x.yaml", ovr)
        assert cfg.model.tokenizer_vocab_only is True
        # the memory setting keeps the fp32 masters as remainders (the config check accepts it there)
        assert cfg.learner.megatron.master_weight_remainders is (setting == "memory")


class _FakeNvml:
    """NVML's answers over time: a device total and its processes (pid, bytes), one tuple a tick."""

    def __init__(self, ticks):
        self.ticks, self.i = ticks, 0

    def _now(self):  # the tick the utilization call (the first of each sample) moved to
        return self.ticks[min(self.i - 1, len(self.ticks) - 1)]

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.i += 1
        return types.SimpleNamespace(gpu=50)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=self._now()[0] * 2**30)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=gib * 2**30) for pid, gib in self._now()[1]]


def test_gpu_sampler_keeps_each_processs_peak_and_the_split_at_the_devices_peak():
    import os
    import time

    from bench.peers.common import GpuSampler

    me, gone = os.getpid(), 2**22 + 7  # this process, and a pid no process has
    ticks = [(10, [(me, 4), (gone, 6)]), (30, [(me, 20), (gone, 10)])] + [(25, [(me, 5), (gone, 20)])] * 20
    sampler = GpuSampler()
    sampler._nvml, sampler._handle = _FakeNvml(ticks), None
    sampler.start()
    deadline = time.monotonic() + 20
    while sampler._nvml.i < len(ticks) and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    out = sampler.processes()
    mine = next(k for k in out["peak"] if k.endswith(f"({me})"))
    other = f"pid {gone}"  # no /proc entry: named by its pid alone
    assert set(out["peak"]) == {mine, other}
    assert "python" in mine or "pytest" in mine
    assert out["peak"][mine] == 20 and out["peak"][other] == 20  # each one's own highest, at different times
    assert out["at_device_peak"] == {mine: 20, other: 10}  # the split when the total was highest (30)
    assert sampler.peak_gib() == 30


def test_close_result_keeps_the_process_split_only_where_nvml_listed_processes():
    from bench.peers.common import GpuSampler, Result, close_result

    quiet = GpuSampler()
    quiet._nvml = None
    res = close_result(Result(system="agentrl", setting="memory", workload="multi", steps=1), quiet, None, 1)
    assert "gpu_processes_gib" not in res.extra
    quiet.process_peak_gib, quiet.at_peak = {"VLLM::EngineCore (7)": 42.0}, {"VLLM::EngineCore (7)": 41.5}
    res = close_result(Result(system="agentrl", setting="memory", workload="multi", steps=1), quiet, None, 1)
    assert res.extra["gpu_processes_gib"] == {"peak": {"VLLM::EngineCore (7)": 42.0},
                                             "at_device_peak": {"VLLM::EngineCore (7)": 41.5}}


def test_close_result_says_how_long_the_runner_spent_outside_its_steps(monkeypatch):
    """What a device call must leave room for beside the steps: the runner's time so far, less its steps."""
    from bench.peers import common

    sampler = common.GpuSampler()
    sampler._nvml = None
    monkeypatch.setattr(common, "_STARTED", common.time.monotonic() - 100.0)
    res = common.Result(system="trl", setting="recommended", workload="long", steps=2,
                        extra={"step_walls_s": [30.0, 25.5]})
    res = common.close_result(res, sampler, None, 2)
    assert 100.0 <= res.extra["runner_s"] < 160.0
    assert res.extra["outside_steps_s"] == round(res.extra["runner_s"] - 55.5, 1)
    res = common.close_result(common.Result(system="trl", setting="recommended", workload="long"), sampler, None, 1)
    assert "outside_steps_s" not in res.extra and res.status == "error"  # no step ran


def test_agentrl_runner_cut_by_sigterm_writes_the_steps_it_timed(tmp_path, monkeypatch):
    """A run stopped by its call's time limit (the trainer turns SIGTERM into KeyboardInterrupt)
    still writes a result, status "cut", with the figures of the timed steps it finished, before
    the trainer's shutdown; the runner then exits non-zero."""
    import agentrl.driver.trainer
    from bench.peers import run_agentrl
    from bench.peers.common import harness_parser

    events: list[str] = []

    class StandIn:
        def __init__(self, cfg, progress=True):
            self.rollouts, self.engines, self.engine_start_s = [], [], None  # the Trainer's, set by start
            self.learner = types.SimpleNamespace(memory_report=types.SimpleNamespace(remote=lambda: 1 / 0))

        def start(self):
            events.append("start")
            self.engine_start_s = 2.04
            self.start_s = {"ray": 1.5, "engines": 2.04, "learner": 3.25}

        def _loop(self, logger):
            for step in range(3):  # a warm-up step and two timed ones, then the signal
                logger.log(step, {"train/num_tokens": 1000.0, "rollout/reward": 0.5 + step / 10,
                                  "timing/refit": 0.25, "rollout/tokens_per_s": 100.0, "timing/step": 1.0})
            raise KeyboardInterrupt("stopped by signal SIGTERM")

        def shutdown(self):
            events.append("shutdown:" + ("written" if (tmp_path / "out.json").is_file() else "nothing"))

    monkeypatch.setattr(agentrl.driver.trainer, "Trainer", StandIn)
    args = harness_parser(run_agentrl.__doc__).parse_args(
        ["--workload", "multi", "--workdir", str(tmp_path), "--out", str(tmp_path / "out.json"), "--steps", "5",
         "--warmup", "1"])
    args.cpu, args.engine_mem, args.set = True, 0.2, []
    with pytest.raises(SystemExit, match="stopped by signal SIGTERM after 3 of 6 steps"):
        run_agentrl.run_setting(args, WORKLOADS["multi"], str(tmp_path / "model"), str(tmp_path / "t.json"), "like")
    (row,) = json.loads((tmp_path / "out.json").read_text())
    assert row["status"] == "cut" and row["steps"] == 2 and row["reward_curve"] == [0.5, 0.6, 0.7]
    assert row["extra"]["start_s"]["engines"] == 2.0 and row["extra"]["start_s"]["trainer_start"] >= 0
    assert row["extra"]["start_s"]["trainer_parts"] == {"ray": 1.5, "engines": 2.04, "learner": 3.25}
    assert "AttributeError" in row["extra"]["start_s"]["learner_build"]  # no timeline: the run goes on
    # what ran, in the row: the engine's step budget (CPU here: vLLM's own) and the core attention
    assert row["extra"]["config"]["engine_batched_tokens"] is None and row["extra"]["config"]["attention"] == "auto"
    assert row["trained_tokens_per_step"] == 1000.0 and row["trained_tokens_per_s_per_gpu"] > 0
    assert row["weight_sync_s"] == 0.25 and "ZeroDivisionError" in row["extra"]["learner_memory_gib"]
    assert events == ["start", "shutdown:written"]
    assert "cut: stopped by signal SIGTERM after 3 of 6 steps" in table([row])


def test_kv_blocks_become_the_engines_kv_cache_size(tmp_path):
    """--kv-blocks N sets engine.gpu_kv_cache_gib to N blocks of the model's K and V (vLLM: 16
    tokens a block); the Qwen2.5-1.5B shape holds 458,752 bytes a block."""
    from pathlib import Path

    from bench.peers import run_agentrl
    from bench.peers.common import harness_parser

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 28, "hidden_size": 1536,
                                                      "num_attention_heads": 12, "num_key_value_heads": 2}))
    assert run_agentrl.kv_cache_gib(str(tmp_path), 1) * 2**30 == 458_752
    args = harness_parser(run_agentrl.__doc__).parse_args(["--workload", "multi", "--workdir", str(tmp_path)])
    args.cpu, args.engine_mem, args.set, args.kv_blocks = False, 0.2, [], 90_000
    ovr = run_agentrl.overrides(args, WORKLOADS["multi"], str(tmp_path), str(tmp_path / "t.json"), "memory")
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "gpu_1x.yaml", ovr)
    assert round(cfg.engine.gpu_kv_cache_gib * 2**30) == 90_000 * 458_752
    # or read from TRL's result in the same peers.json: its last row on the workload
    rows = [{"system": "trl", "workload": "multi", "extra": {"kv_blocks": 70_000}},
            {"system": "agentrl", "workload": "multi", "extra": {"kv_blocks": 1}},
            {"system": "trl", "workload": "single", "extra": {"kv_blocks": 5}},
            {"system": "trl", "workload": "multi", "extra": {"kv_blocks": 80_000}}]
    (tmp_path / "peers.json").write_text(json.dumps(rows))
    args.kv_blocks, args.kv_blocks_from = 0, str(tmp_path / "peers.json")
    ovr = run_agentrl.overrides(args, WORKLOADS["multi"], str(tmp_path), str(tmp_path / "t.json"), "memory")
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "gpu_1x.yaml", ovr)
    assert round(cfg.engine.gpu_kv_cache_gib * 2**30) == 80_000 * 458_752
    with pytest.raises(SystemExit, match="no peer result on 'long'"):
        run_agentrl.overrides(args, WORKLOADS["long"], str(tmp_path), str(tmp_path / "t.json"), "memory")


def test_agentrl_runner_treats_longNk_as_the_long_workload(tmp_path):
    """longNk runs as long does (the engine sleeps while the learner steps), with room for its length."""
    from pathlib import Path

    from bench.peers import run_agentrl
    from bench.peers.common import harness_parser

    args = harness_parser(run_agentrl.__doc__).parse_args(["--workload", "long32k", "--workdir", str(tmp_path)])
    args.cpu, args.engine_mem, args.set = False, 0.2, []
    wl = workload(args.workload)
    ovr = run_agentrl.overrides(args, wl, str(tmp_path / "model"), str(tmp_path / "t.json"), "recommended")
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "gpu_1x.yaml", ovr)
    assert cfg.colocate.engine_sleep is True and cfg.engine.gpu_memory_utilization == 0.25
    assert cfg.engine.max_model_len >= wl.episode_tokens and cfg.packing.max_tokens_per_microbatch >= wl.episode_tokens
    # its learner recomputes the micro-batches whose activations would not fit (long64k OOMed without)
    assert cfg.learner.megatron.recompute_above_tokens == "auto" and cfg.learner.megatron.cuda_graphs is False


def test_fit_probe_batch_keeps_the_episode_length_and_names_the_smaller_batch(tmp_path, capsys):
    """--group-size / --prompts-per-step (device.sh fit probes): the same episodes, fewer of them a
    step, under a name of their own; agentrl's micro-batch and engine stay those of the full workload."""
    from pathlib import Path

    from bench.peers import run_agentrl
    from bench.peers.common import harness_parser, run_workload

    parser = harness_parser(run_agentrl.__doc__)
    full = run_workload(parser.parse_args(["--workload", "long64k"]))
    assert full == workload("long64k")  # nothing given: the workload itself, its own name
    args = parser.parse_args(["--workload", "long64k", "--group-size", "4", "--prompts-per-step", "1",
                              "--workdir", str(tmp_path)])
    probe = run_workload(args)
    assert probe.name == "long64k-g4p1" and (probe.group_size, probe.prompts_per_step) == (4, 1)
    assert probe.episode_tokens == full.episode_tokens and probe.obs_tokens == full.obs_tokens
    args.cpu, args.engine_mem, args.set = False, 0.2, []
    root = Path(__file__).resolve().parents[1]
    cfgs = [load_config(root / "configs" / "gpu_1x.yaml",
                        run_agentrl.overrides(args, wl, str(tmp_path / "m"), str(tmp_path / "t.json"), "recommended"))
            for wl in (full, probe)]
    assert (cfgs[1].rollout.group_size, cfgs[1].replay.groups_per_step) == (4, 1)
    assert cfgs[1].packing.max_tokens_per_microbatch == cfgs[0].packing.max_tokens_per_microbatch
    assert cfgs[1].engine.gpu_memory_utilization == cfgs[0].engine.gpu_memory_utilization
    with pytest.raises(SystemExit, match="group-size must be >= 2"):
        run_workload(parser.parse_args(["--workload", "long64k", "--group-size", "1"]))


def test_peer_model_serves_the_longest_fit_episode_and_keeps_its_weights_when_its_context_grows(tmp_path, monkeypatch):
    """The harness's model takes every longNk episode (past 32k too); a model made earlier with a
    shorter context gets the new one in its config and keeps its weight file untouched."""
    from bench.peers.common import MAX_POSITIONS, make_model

    monkeypatch.setenv("AGENTRL_PEERS_MAKE_MODEL_HERE", "1")  # no child process, no GPU here
    out = tmp_path / "model"
    make_model(out, "cpu", max_position_embeddings=32768)
    weights = sorted(out.glob("model*.safetensors"))
    before = [(f.stat().st_mtime_ns, f.read_bytes()) for f in weights]
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 32768
    make_model(out, "cpu")
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == MAX_POSITIONS
    from bench.peers import run_verl

    longest = workload("long512k")  # the longest longNk: every runner's engine length fits in the model
    assert MAX_POSITIONS >= max(longest.episode_tokens + 512, run_verl.lengths(longest)["model_len"])
    assert [(f.stat().st_mtime_ns, f.read_bytes()) for f in sorted(out.glob("model*.safetensors"))] == before


def test_runners_starting_at_once_make_the_model_one_after_the_other(tmp_path, monkeypatch):
    """Two queues (one GPU each) may start runners at once on a fresh machine: make_model holds a lock
    beside the model while it checks and makes it, so the second finds it made instead of writing the
    same files at the same time."""
    import threading
    import time

    from bench.peers import common

    spans: list[tuple[float, float]] = []

    def slow_make(out, shape, max_positions):
        t0 = time.monotonic()
        time.sleep(0.3)
        spans.append((t0, time.monotonic()))
        return str(out)

    monkeypatch.setattr(common, "_make_model", slow_make)
    threads = [threading.Thread(target=common.make_model, args=(tmp_path / "model", "cpu")) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans.sort()
    assert len(spans) == 3 and all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans  # never two at once


@pytest.mark.parametrize(("visible", "index"), [(None, 0), ("", 0), ("1", 1), ("1,0", 1), (" 3 , 2", 3)])
def test_the_gpu_sampler_watches_the_gpu_the_runs_see(visible, index, monkeypatch):
    """nvml_index: NVML numbers every GPU of the host whatever CUDA_VISIBLE_DEVICES says, so a queue on
    GPU 1 (device.sh GPU=1) must sample NVML's GPU 1, not GPU 0 where the other queue runs."""
    from bench.peers.common import nvml_index

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert nvml_index() == index


def test_sigterm_becomes_a_keyboardinterrupt_a_runner_can_write_its_steps_from():
    """stop_on_sigterm (run_trl's main): timeout's SIGTERM interrupts the main thread as Ctrl-C
    would, instead of ending the process before it writes what it measured."""
    import os
    import signal

    from bench.peers.common import stop_on_sigterm

    before = signal.getsignal(signal.SIGTERM)
    try:
        stop_on_sigterm()
        with pytest.raises(KeyboardInterrupt, match="stopped by signal SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at the next bytecode boundary
                pass
    finally:
        signal.signal(signal.SIGTERM, before)


def test_agentrl_result_says_where_each_steps_time_went_and_what_recomputed():
    """run_agentrl.summarize keeps each step's timing/* metrics and the recompute counts, so a slow
    long-context step can be split (waiting for rollouts vs the learner) from its result alone."""
    from bench.peers.common import Result
    from bench.peers.run_agentrl import summarize

    rows = [{"train/num_tokens": 1000.0, "timing/step": 10.0, "timing/learner_step": 7.5, "timing/waiting": 2.0,
             "train/recomputed_microbatches": 4.0, "train/recomputed_layers": 13.5},
            {"train/num_tokens": 1000.0, "timing/step": 8.0, "timing/learner_step": 6.25, "timing/waiting": 1.0,
             "train/recomputed_microbatches": 4.0, "train/recomputed_layers": 14.0, "train/attention_kept_layers": 14.0}]
    res = Result(system="agentrl", setting="recommended", workload="long64k")
    summarize(res, rows, [10.0, 18.0], 0.0, warmup=1)
    assert res.extra["timing_by_step_s"] == [{"step": 10.0, "learner_step": 7.5, "waiting": 2.0},
                                             {"step": 8.0, "learner_step": 6.25, "waiting": 1.0}]
    assert res.extra["recompute_by_step"] == [{"microbatches": 4.0, "layers_mean": 13.5, "attention_kept_mean": 0.0},
                                              {"microbatches": 4.0, "layers_mean": 14.0, "attention_kept_mean": 14.0}]
    assert res.step_time_s == 8.0 and res.trained_tokens_per_s_per_gpu == 125.0
    plain = Result(system="agentrl", setting="like", workload="multi")
    summarize(plain, [{k: v for k, v in rows[0].items() if "recompute" not in k}], [10.0], 0.0, warmup=0)
    assert "recompute_by_step" not in plain.extra  # no recompute setting: no recompute figures


def test_trl_sleep_setting_is_recommended_with_the_engine_asleep_while_training(tmp_path, capsys, monkeypatch):
    """run_trl's `sleep` setting (the fit probes' memory saver) differs from `recommended` only in
    vLLM's sleep mode; `like` drops recompute; an unknown setting stops before any model is made."""
    from bench.peers import run_trl
    from bench.peers.common import harness_parser, run_workload

    parser = harness_parser(run_trl.__doc__)
    parser.add_argument("--engine-mem", type=float, default=0.3)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args(["--workload", "long256k", "--group-size", "2", "--prompts-per-step", "1",
                              "--workdir", str(tmp_path)])
    wl = run_workload(args)
    kw = {s: run_trl.config_kwargs(args, wl, s, 1, wl.episode_tokens, 6) for s in run_trl.SETTINGS}
    assert kw["sleep"]["vllm_enable_sleep_mode"] is True and kw["recommended"]["vllm_enable_sleep_mode"] is False
    differ = {k for k in kw["sleep"] if kw["sleep"][k] != kw["recommended"][k]}
    assert differ == {"vllm_enable_sleep_mode", "output_dir"}
    assert kw["sleep"]["gradient_accumulation_steps"] == 2 and kw["sleep"]["vllm_max_model_length"] > wl.episode_tokens
    assert kw["like"]["gradient_checkpointing"] is False and kw["recommended"]["gradient_checkpointing"] is True
    args.cpu = True  # the CPU check has no vLLM to put to sleep
    assert run_trl.config_kwargs(args, wl, "sleep", 1, wl.episode_tokens, 6)["vllm_enable_sleep_mode"] is False
    monkeypatch.setattr("sys.argv", ["run_trl.py", "--workload", "long", "--settings", "recommended,fast",
                                     "--workdir", str(tmp_path)])
    with pytest.raises(SystemExit):
        run_trl.main()
    assert "unknown setting(s) fast" in capsys.readouterr().err
    assert not any(tmp_path.glob("model-*"))  # refused before the harness model was made


def test_verl_run_stopped_by_its_timeout_is_cut_not_an_error(tmp_path, monkeypatch):
    """run_verl's --timeout ends a verl still busy: status "cut" with the time and the steps done (as
    the other runners' cut runs), not "error" with whatever verl printed last (an import warning of
    the 2026-11-29 probe at 128k) as if it were the cause."""
    import argparse

    from bench.peers import run_verl

    fake = tmp_path / "fake" / "verl" / "trainer"
    fake.mkdir(parents=True)
    for d in (fake.parent, fake):
        (d / "__init__.py").write_text("")
    (fake / "main_ppo.py").write_text(
        "import time\nprint(\"UserWarning: automodel engine is not available: ModuleNotFoundError('x')\", flush=True)\n"
        "time.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setattr(run_verl, "overrides", lambda *a, **k: [])
    args = argparse.Namespace(workdir=str(tmp_path), timeout=3, warmup=1, steps=5, set=[])
    res = run_verl.run_setting(args, workload("long16k"), "model", {}, "recommended")
    assert res.status == "cut", (res.status, res.reason)
    assert res.reason == "timed out after 3s, 0 of 6 steps done (warm-up included)", res.reason
