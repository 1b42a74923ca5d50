"""The rollout service: engines on leased devices, the router, executions, weights, endpoints.

    start:  router + step publisher + weight follower (gyre.weights.<run>)
            devices: standalone -> an engine on each; with a scheduler -> RegisterWorker, then follow
            gyre.leases.<run>.* and Heartbeat replies (LeaseFollower), ReportLoad every few seconds
            gRPC Rollout (Generate, StartExecutions, GetStatus) + OpenAI-compatible HTTP endpoint
            executions: num_tasks x group_size at boot (optionally continuous); a restarted process
            (GYRE_INCARNATION >= 1) first resumes what its predecessor left running (resume.py)
    stop:   stop starting executions, let live ones finish (bounded by the drain timeout),
            drain every engine, flush the step publisher

Errors: RPCs go through gyre.rpc.error_boundary; a crashed execution becomes FAILED (agent.py);
any background loop that dies takes the service down (Runtime.spawn), except a torch engine's: a
crashed engine's requests resume on the others and it is restarted on its device (engine_recovery.py)
up to `engine_max_restarts` times.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre import rpc
from gyre.bus import subjects
from gyre.config import CommonConfig
from gyre.errors import ConfigError, InvalidArgument
from gyre.lease_client import LeaseClient
from gyre.pacing import Pacer
from gyre.service import Runtime, Service
from gyre.v1 import (
    common_pb2,
    events_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    waits_pb2,
)
from gyre.waits import wait

from .agent import Agent, AgentConfig, call_seed
from .config import RolloutConfig
from .engine_recovery import EngineRestarter
from .engines.base import Engine, GenerationRequest, Sampling
from .environments.base import TaskFamily
from .executions import ExecutionManager
from .leases import EngineDevices
from .resume import ResumePlan

if TYPE_CHECKING:
    from .engines.vllm_server import VLLMServers
from .router import Router
from .steps import BusStepSink
from .weights import WeightSwapper

log = logging.getLogger(__name__)


def make_family(cfg: RolloutConfig, seed: int, pacer: Pacer | None = None) -> TaskFamily:
    if cfg.environment == "workload":  # the workload file of devices.pacing (gyre/pacing.py)
        from gyre.workload import load_workload_file

        from .environments.workload_plans import WorkloadFamily

        pacer = pacer or Pacer()
        if pacer.cfg.workload_file is None:
            raise ConfigError("rollout.environment 'workload' needs devices.pacing.workload_file")
        workload = load_workload_file(pacer.cfg.workload_file)
        return WorkloadFamily(workload, pacer, pacer.cfg.time_scale, tokens_per_call=cfg.max_tokens)
    if cfg.environment == "workspace":
        from .environments.workspace import WorkspaceFamily

        return WorkspaceFamily.from_jsonl(cfg.workspace_tasks)
    from .environments.longhorizon import LongHorizonFamily, LongHorizonSpec

    return LongHorizonFamily(
        LongHorizonSpec(
            num_actions=cfg.longhorizon_num_actions,
            min_turns=cfg.longhorizon_min_turns,
            max_turns=cfg.longhorizon_max_turns,
            seed=seed,
        )
    )


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, service: RolloutService) -> None:
        self.s = service

    @rpc.error_boundary
    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: Any
    ) -> rollout_pb2.GenerateResponse:
        sp = request.sampling
        if not request.request_id:
            raise InvalidArgument("request_id must be set")
        seed = sp.seed or call_seed(0, request.request_id, 0)
        sampling = Sampling(
            temperature=sp.temperature,
            max_tokens=sp.max_tokens,
            seed=seed,
            stop_token_ids=tuple(sp.stop_token_ids),
            top_p=sp.top_p or 1.0,
        )
        out = await self.s.router.generate(
            GenerationRequest(
                request.request_id,
                list(request.prompt_token_ids),
                sampling,
                execution_id=request.execution_id,
            )
        )
        return rollout_pb2.GenerateResponse(
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            versions=out.versions,
            finish_reason=out.finish_reason,
            num_migrations=out.num_migrations,
            engine_ids=out.engine_ids,
        )

    @rpc.error_boundary
    async def StartExecutions(
        self, request: rollout_pb2.StartExecutionsRequest, context: Any
    ) -> rollout_pb2.StartExecutionsResponse:
        if request.num_tasks <= 0 or request.group_size <= 0:
            raise InvalidArgument("num_tasks and group_size must be > 0")
        ids = self.s.executions.start(request.num_tasks, request.group_size)
        return rollout_pb2.StartExecutionsResponse(execution_ids=ids)

    @rpc.error_boundary
    async def GetStatus(
        self, request: rollout_pb2.GetStatusRequest, context: Any
    ) -> rollout_pb2.GetStatusResponse:
        return self.s.status()


class RolloutService(Service):
    name = "rollout"

    def __init__(self, common: CommonConfig, cfg: RolloutConfig) -> None:
        self.common, self.cfg = common, cfg
        self.router = Router(max_staleness=cfg.max_staleness)
        self.swapper = WeightSwapper(
            self.router,
            store=cfg.weights_store or common.run_dir / "weights",
            max_version_ahead=cfg.weights_max_version_ahead,
        )
        self.state = common_pb2.SERVICE_STATE_STARTING
        self.restarter: EngineRestarter | None = None  # set in start(): crashed engines come back
        self._engine_seq = 0
        # Busy seconds last read from each engine this worker ran, lent-away ones included (WorkerLoad).
        self._busy_s_by_engine: dict[str, float] = {}
        # paced devices (devices.pacing; off: no wait anywhere)
        self.pacer = Pacer(
            common.devices.pacing, busy_log_path=common.run_dir / "pacing" / f"{cfg.worker_id}.jsonl"
        )
        self.http: Any = None
        self.vllm_servers: VLLMServers | None = None  # engine 'vllm' without urls: the servers we run
        self.http_port = 0
        # version 0 must be the trainer's version 0: the trainer seeds it with the run's seed
        self.init_seed = common.seed if cfg.init_seed is None else cfg.init_seed
        if self.init_seed != common.seed and cfg.init_weights is None:
            log.warning(
                "rollout.init_seed %d differs from the run's seed %d: until the first weights version "
                "arrives, engines sample from a model the trainer never had",
                self.init_seed,
                common.seed,
            )

    # -- engines -----------------------------------------------------------------------------
    def _new_engine(self, device_id: str) -> Engine:
        index = self.cfg.device_ids().index(device_id)
        self._engine_seq += 1
        engine_id = f"{device_id}-e{self._engine_seq}"
        if self.cfg.engine == "vllm":
            from .engines.vllm_engine import VLLMEngine

            v = self.cfg.vllm
            started = self.vllm_servers is not None
            return VLLMEngine(
                engine_id,
                device_id,
                self.vllm_servers.spec(device_id).url if self.vllm_servers is not None else v.urls[index],
                api_key=self.vllm_servers.spec(device_id).api_key if started else None,  # type: ignore[union-attr]
                timeout_s=v.request_timeout_s,
                start_timeout_s=v.start_timeout_s,
                sleep_level=v.sleep_level,
                sleep_mode=v.platform_for(self.cfg.device_kind) == "cuda",
                initial_weights=self.swapper.latest,
                on_failure=self.restarter.on_failure if self.restarter is not None else None,  # type: ignore[arg-type]
            )
        from .engines.torch_engine import TorchEngine

        return TorchEngine(
            engine_id,
            device_id,
            self.cfg.model,
            torch_device="cpu" if self.cfg.device_kind == "cpu" else f"cuda:{index}",
            max_batch=self.cfg.engine_max_batch,
            init_seed=self.init_seed,
            initial_weights=self.swapper.latest,
            init_weights=self.cfg.init_weights,
            pacer=self.pacer,
            on_failure=self.restarter.on_failure if self.restarter is not None else None,
        )

    async def _started_engine(self, device_id: str) -> Engine:
        """A new engine on `device_id`, started, with the newest weights this rollout has loaded."""
        engine = self._new_engine(device_id)
        await engine.start()
        if self.swapper.latest is not None:
            await engine.load_weights(self.swapper.latest)
        return engine

    async def _catch_up(self, engine: Engine) -> None:
        """Load a version published while `engine` was starting (nothing if it has the newest)."""
        latest = self.swapper.latest
        if latest is not None and engine.weight_version < latest.version:
            await engine.load_weights(latest)

    async def _on_groups_dropped(self, msgs: list[events_pb2.GroupDroppedEvent]) -> None:
        """Give back the admission slot of each group of ours the trajectory service will not train."""
        for ev in msgs:
            if await self.executions.on_group_dropped(ev.group_id):
                log.info("group %s will not be trained (%s): its admission slot is free again", ev.group_id,
                         ev.reason)  # fmt: skip

    def _inject_engine_fault(self) -> None:
        """SIGUSR2 with rollout.fault_injection: fail the torch engine holding the most requests."""
        from .engines.torch_engine import TorchEngine

        engines = [e for e in self.router.engines.values() if isinstance(e, TorchEngine)]
        if not engines:
            log.warning("SIGUSR2: no torch engine to inject a fault into")
            return
        engine = max(engines, key=lambda e: e.num_active)
        log.warning("SIGUSR2: injecting a device fault into engine %s (%d requests)", engine.engine_id,
                    engine.num_active)  # fmt: skip
        engine.inject_fault(f"injected device fault (SIGUSR2) on {engine.device_id}")

    async def start_engine(self, device_id: str) -> None:
        if device_id in self.router.engines:
            return
        engine = await self._started_engine(device_id)
        await self.router.add_engine(engine)
        log.info("engine %s serving on %s (weights v%d)", engine.engine_id, device_id, engine.weight_version)

    async def stop_engine(self, device_id: str) -> None:
        t0 = self.pacer.clock()
        await self.router.remove_engine(device_id)
        # paced: the device changes role (to training) before it is released
        await self.pacer.wait("role_change", t0, lambda: self.pacer.role_change_s("train"))
        log.info("engine on %s drained and stopped", device_id)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, rt: Runtime) -> None:
        cfg, run_id = self.cfg, self.common.run_id
        self.rt = rt
        self.restarter = EngineRestarter(
            self.router, self._started_engine, rt.spawn, max_restarts=cfg.engine_max_restarts,
            backoff_s=cfg.engine_restart_backoff_s, catch_up=self._catch_up,
        )  # fmt: skip
        self.sink = BusStepSink(
            rt.bus,
            max_buffer=cfg.step_buffer,
            vocab_size=cfg.model.vocab_size,
            max_step_bytes=cfg.step_max_bytes,
        )
        rt.spawn(self.sink.run(), "step-publisher")
        if cfg.engine == "vllm" and not cfg.vllm.urls:
            await self._start_vllm_servers(rt)
        from gyre.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer)
        agent_cfg = AgentConfig(
            stop_token_ids=tokenizer.stop_ids,
            temperature=cfg.temperature,
            max_tokens=cfg.max_tokens,
            max_calls=cfg.max_calls,
            max_context_tokens=cfg.max_context_tokens,
            context=cfg.context,
            compact_every=cfg.compact_every,
            keep_last_turns=cfg.keep_last_turns,
        )
        self.executions = ExecutionManager(
            Agent(self.router, self.sink, agent_cfg, tokenizer),
            make_family(cfg, self.common.seed, self.pacer),
            run_id=run_id,
            seed=self.common.seed,
            max_live=cfg.max_live_executions,
            continuous=cfg.continuous,
            groups_per_version=cfg.groups_per_version,
            staleness_bound=cfg.max_staleness,
        )
        self.swapper.on_loaded = self.executions.on_version
        rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(self), rt.server)
        # A restarted rollout's durable weights consumer acked every earlier event: start from the
        # newest version stored on the bus, or its engines would serve v0, too stale for admission.
        newest = await rt.bus.last(subjects.weights(run_id), events_pb2.WeightsPublishedEvent)
        if newest is not None:
            await self.swapper.handle([newest])
        await rt.bus.consume(
            subjects.weights(run_id),
            events_pb2.WeightsPublishedEvent,
            self.swapper.handle,
            durable=f"rollout-{cfg.worker_id}-weights",
        )
        if cfg.continuous and cfg.groups_per_version > 0:
            # Groups the trajectory service will never train give their admission slot back.
            await rt.bus.consume(
                subjects.paths_dropped(run_id),
                events_pb2.GroupDroppedEvent,
                self._on_groups_dropped,
                durable=f"rollout-{cfg.worker_id}-dropped",
            )
        if cfg.fault_injection:
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, self._inject_engine_fault)
        if cfg.scheduler_address is None:
            for device in cfg.device_ids():
                await self.start_engine(device)
        else:
            await self._join_scheduler(rt)
        if cfg.openai.port is not None:
            from .openai import OpenAIEndpoint, create_app, endpoint_keys, serve

            key_dir = self.common.run_dir / "rollout" / cfg.worker_id
            api_key, admin_key = endpoint_keys(
                cfg.openai.api_key, cfg.openai.admin_key, key_dir, require_api_key=cfg.openai.auth
            )
            from gyre.tokenizers import load_tokenizer

            endpoint = OpenAIEndpoint(
                self.router, self.sink, run_id=run_id, tokenizer=load_tokenizer(cfg.tokenizer),
                vocab_size=cfg.model.vocab_size, seed=self.common.seed, api_key=api_key,
                admin_key=admin_key, max_prompt_tokens=cfg.model.max_position_embeddings,
                max_request_bytes=cfg.openai.max_request_bytes, execution_idle_s=cfg.openai.execution_idle_s,
            )  # fmt: skip
            self.http, self.http_port = await serve(create_app(endpoint), cfg.openai.host, cfg.openai.port)
            if cfg.harness.kind == "external":  # executions run the user's agent against this endpoint
                from .harness import build_external_harness

                self.executions.agent, self.executions.family = build_external_harness(
                    cfg.harness, endpoint, self.sink, self.executions.family
                )
            log.info(
                "OpenAI-compatible endpoint on http://%s:%d/v1; use it with OPENAI_BASE_URL=http://%s:%d/v1 "
                "OPENAI_API_KEY=$(cat %s) (admin key: %s)",
                cfg.openai.host, self.http_port, cfg.openai.host, self.http_port,
                key_dir / "openai_api_key" if cfg.openai.api_key is None else "rollout.openai.api_key",
                key_dir / "openai_admin_key" if cfg.openai.admin_key is None else "rollout.openai.admin_key",
            )  # fmt: skip
        if self.executions.incarnation:  # restarted: resume what the killed predecessor left running
            await self._resume_predecessors(rt)
        if cfg.num_tasks:
            self.executions.start(cfg.num_tasks, cfg.group_size, skip_resumed=True)
        self.state = common_pb2.SERVICE_STATE_SERVING

    async def _start_vllm_servers(self, rt: Runtime) -> None:
        """One supervised `vllm serve` per device (services/rollout/engines/vllm_server.py)."""
        from .engines.vllm_server import VLLMServers

        cfg, v = self.cfg, self.cfg.vllm
        model = v.model if v.model is not None else cfg.init_weights
        assert model is not None  # RolloutConfig refuses engine 'vllm' without one
        self.vllm_servers = VLLMServers.for_devices(
            cfg.device_ids(),
            model=Path(model),
            weights_store=cfg.weights_store or self.common.run_dir / "weights",
            log_dir=self.common.run_dir / "logs",
            tensor_parallel_size=v.tensor_parallel_size,
            host=v.host,
            port=v.port,
            command=tuple(v.command),
            python=v.python,
            platform=v.platform_for(cfg.device_kind),
            cpu_kv_cache_gib=v.cpu_kv_cache_gib,
            gpu_memory_utilization=v.gpu_memory_utilization,
            max_model_len=v.max_model_len or cfg.model.max_position_embeddings,
            seed=self.common.seed,
            extra_args=tuple(v.extra_args),
            start_timeout_s=v.start_timeout_s,
            max_restarts=v.max_restarts,
        )
        await self.vllm_servers.start()
        rt.spawn(self.vllm_servers.watch(), "vllm-servers")

    async def _resume_predecessors(self, rt: Runtime) -> None:
        """Resume (or end, with the reason) every execution the previous process of this worker left
        running (services/rollout/resume.py). A bus that cannot be read leaves them to the
        trajectory service, which scores an unended execution as partial once its group waited."""
        try:
            plan = await ResumePlan.load(rt.bus, self.common.run_id)
        except Exception as exc:
            log.warning("could not read the executions of the previous rollout process: %r", exc)
            return
        resumed, ended = await self.executions.resume(plan, self.sink, self.cfg.group_size)
        self.executions.counters.interrupted += len(ended)
        log.info(
            "previous rollout process left %d executions running: %d resumed, %d ended",
            len(plan.points), len(resumed), len(ended),
        )  # fmt: skip

    async def _join_scheduler(self, rt: Runtime) -> None:
        """Become a worker of the pool: engines start and stop as the scheduler's leases say."""
        cfg = self.cfg
        assert cfg.scheduler_address is not None
        self.channel = rpc.channel(cfg.scheduler_address)
        devices = [
            common_pb2.Device(device_id=d, node=cfg.node, index=i, kind=cfg.device_kind)
            for i, d in enumerate(cfg.device_ids())
        ]
        engines = EngineDevices(cfg.device_ids(), self.router.engines, self.start_engine, self.stop_engine)
        self.leases = LeaseClient(
            cfg.worker_id,
            "rollout",
            scheduler_pb2_grpc.SchedulerStub(self.channel),
            engines,
            self._load,
            devices=devices,
            address=f"127.0.0.1:{rt.port}",
            spawn=rt.spawn,
        )
        await self.leases.register()
        await rt.bus.consume(
            subjects.leases(self.common.run_id, "*"),
            events_pb2.LeaseEvent,
            self.leases.on_events,
            durable=f"rollout-{cfg.worker_id}-leases",
        )
        rt.spawn(self.leases.heartbeat_forever(), "heartbeat")
        rt.spawn(self.leases.report_load_forever(cfg.report_load_interval_s), "report-load")

    def _load(self) -> scheduler_pb2.WorkerLoad:
        engines = list(self.router.engines.values())
        running = sum(e.num_active for e in engines)
        for e in engines:  # an engine's busy time stays counted after it is lent away
            self._busy_s_by_engine[e.engine_id] = e.busy_s
        return scheduler_pb2.WorkerLoad(
            live_executions=len(self.executions.live),
            queued_generations=max(0, self.router.in_flight - running),
            running_generations=running,
            weight_version=min((e.weight_version for e in engines), default=0),
            engine_capacity=self.cfg.engine_max_batch,
            busy_device_s=sum(self._busy_s_by_engine.values()),
            engines=[
                scheduler_pb2.EngineLoad(
                    device_id=e.device_id,
                    executions=e.num_active,
                    generating=e.num_generating,
                    context_tokens=e.context_tokens,
                )
                for e in engines
            ],
        )

    def waits(self) -> list[waits_pb2.Wait]:
        """Admission waiting for a version, generations queued for an engine, engines not serving."""
        out = []
        if admission := self.executions.admission_wait():
            out.append(wait("admission", admission))
        elif not self.executions.live:
            out.append(wait("executions", "no live execution and none waiting to start (a group's end or "
                            "Rollout.StartExecutions starts one)"))  # fmt: skip
        running = sum(e.num_active for e in self.router.engines.values())
        if (queued := self.router.in_flight - running) > 0:
            out.append(wait("generation", f"{queued} generations queued for an engine ({running} running)"))
        if not self.router.engines:
            out.append(wait("engines", "no engine: the rollout holds no device"))
        latest = self.swapper.latest.version if self.swapper.latest is not None else 0
        for e in self.router.engines.values():
            if e.weight_version < latest:
                out.append(wait("weights", f"engine {e.engine_id} at version {e.weight_version} of {latest}"))
        return out

    def status(self) -> rollout_pb2.GetStatusResponse:
        c = self.executions.counters
        return rollout_pb2.GetStatusResponse(
            engines=[
                rollout_pb2.EngineStatus(
                    engine_id=e.engine_id,
                    device_id=e.device_id,
                    state=str(e.state),
                    weight_version=e.weight_version,
                    running=e.num_active,
                    tokens_generated=e.tokens_generated,
                )
                for e in self.router.engines.values()
            ],
            live_executions=len(self.executions.live),
            executions_started=c.started,
            executions_completed=c.completed,
            executions_interrupted=c.interrupted,
            executions_resumed=c.resumed,
            engine_restarts=self.restarter.num_restarts if self.restarter is not None else 0,
            migrations=self.router.stats.migrations,
            state=self.state,  # type: ignore[arg-type]
        )

    async def stop(self) -> None:
        self.state = common_pb2.SERVICE_STATE_DRAINING
        await self.executions.stop()
        for device in list(self.router.engines):
            await self.router.remove_engine(device)
        if self.http is not None:
            self.http.should_exit = True
            await self.http.gyre_task
        await self.sink.flush()
        if self.vllm_servers is not None:
            await asyncio.to_thread(self.vllm_servers.stop)
        self.state = common_pb2.SERVICE_STATE_STOPPED
        log.info("rollout stopped at %.0f", time.time())


def build(common: CommonConfig, cfg: RolloutConfig) -> RolloutService:
    return RolloutService(common, cfg)
