"""The cluster specs `msjax-launch` writes, and the checks before it writes anything.

- Kubernetes: every object of the manifest, unsupervised and supervised, validates against the Kubernetes 1.37
  API schema of the pinned `kubernetes` client (its pydantic models: unknown fields and wrong types are errors);
  the JobSet's own fields against the JobSet v1alpha2 API's rules (a rule's name pattern and action enum, from
  jobset's api/jobset/v1alpha2/jobset_types.go). The failure policy treats a worker stopped resumably (75, 130,
  143) as a restart that does not count, never as a finished pod.
- SLURM: the sbatch script passes `bash -n`, carries every directive asked (account, QoS, extra lines, working
  directory), runs the setup block before anything of msjax, starts the workers as the installed `msjax-train`
  (no path into a checkout), resumes when requeued and requeues itself after a resumable stop; supervised it
  holds spares and --no-kill and runs `msjax-supervise` as the controller.
- Before anything is rendered or started, a mesh that does not fit num_processes x devices_per_process, or a
  model that does not fit the devices' memory, is the trainer's own error, exit status 2, nothing written.
Rendering runs in-process (msjax.launch.cli.main), as the console command calls it.
"""

import re
import shlex
import subprocess

import pytest
import yaml

from msjax.launch import cli as launch_cli

FLAGS = ["--config=gpt_tiny", "--train.steps=300", "--mesh.data=-1", "--mesh.tensor=2", "--train.global_batch=64",
         "--data.paths=my corpus/"]


def _launch(capsys, *args: str, flags=FLAGS) -> tuple[int, str, str]:
    """msjax-launch ARGS -- FLAGS (ARGS may hold the `--` and the train flags themselves)."""
    code = launch_cli.main([*args] if "--" in args else [*args, "--", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def _by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def _check_schema(kinds: dict[str, list[dict]]) -> None:
    """Every object against the Kubernetes API models (core/v1, apps/v1, batch/v1 of Kubernetes 1.37); the
    JobSet's Job template as batch/v1 JobTemplateSpec (so its pod template as core/v1 PodTemplateSpec)."""
    from kubernetes import client

    models = {"Secret": client.V1Secret, "Service": client.V1Service, "Deployment": client.V1Deployment,
              "Job": client.V1Job}
    for kind, docs in kinds.items():
        for doc in docs:
            if kind == "JobSet":
                for rj in doc["spec"]["replicatedJobs"]:
                    client.V1JobTemplateSpec.model_validate(rj["template"])
                for rule in doc["spec"]["failurePolicy"].get("rules", []):
                    assert set(rule) <= {"name", "action", "onJobFailureReasons", "targetReplicatedJobs"}, rule
                    assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"]), rule["name"]
                    assert rule["action"] in ("FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts")
            else:
                models[kind].model_validate(doc)


def _jobset_pod(kinds):
    (js,) = kinds["JobSet"]
    (rjob,) = js["spec"]["replicatedJobs"]
    return js, rjob["template"]["spec"], rjob["template"]["spec"]["template"]["spec"]


def test_k8s_schema_check_catches_what_the_api_would_refuse():
    """The check is strict where the API is: a misspelt field, and a resource count written as a number where the
    schema wants a quantity string (what the manifest once had)."""
    from kubernetes import client
    from pydantic import ValidationError

    ok = {"spec": {"containers": [{"name": "w", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}
    client.V1PodTemplateSpec.model_validate(ok)
    with pytest.raises(ValidationError, match="workDir"):
        client.V1PodTemplateSpec.model_validate({"spec": {"containers": [{"name": "w", "workDir": "/x"}]}})
    with pytest.raises(ValidationError, match="string"):
        client.V1PodTemplateSpec.model_validate(
            {"spec": {"containers": [{"name": "w", "resources": {"limits": {"nvidia.com/gpu": 8}}}]}})


@pytest.mark.parametrize("accelerator,resource", [("gpu", "nvidia.com/gpu"), ("tpu", "google.com/tpu")])
def test_k8s_jobset_manifest(tmp_path, capsys, accelerator, resource):
    out = tmp_path / "job.yaml"
    code, _, err = _launch(capsys, "--backend=k8s", "--num_processes=16", "--devices_per_process=4",
                           "--image=registry.example/msjax:1", "--name=gpt", f"--accelerator={accelerator}",
                           "--max_restarts=5", "--run_id=run-7", f"--output={out}")
    assert code == 0, err
    kinds = _by_kind(list(yaml.safe_load_all(out.read_text())))
    assert sorted(kinds) == ["Deployment", "JobSet", "Secret", "Service"]
    _check_schema(kinds)
    secret = kinds["Secret"][0]
    assert secret["metadata"]["name"] == "gpt-redis" and len(secret["stringData"]["password"]) >= 24
    redis = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    services = {s["metadata"]["name"]: s["spec"] for s in kinds["Service"]}
    assert services["gpt-redis"]["ports"][0]["port"] == 6379
    assert services["gpt"]["clusterIP"] == "None"  # headless: stable DNS names for the coordinator
    assert services["gpt"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": "gpt"}

    js, job, pod = _jobset_pod(kinds)
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert (job["parallelism"], job["completions"], job["completionMode"], job["backoffLimit"]) == (
        16, 16, "Indexed", 0)
    # stopped, resumable (75, 130, 143): the Job fails by its pod failure policy, and the JobSet restarts without
    # counting it; any other failure counts against maxRestarts
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule == {"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "In",
                                                          "values": [75, 130, 143]}}
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 5 and policy["rules"] == [{
        "name": "stopped_resumable", "action": "RestartJobSetAndIgnoreMaxRestarts",
        "onJobFailureReasons": ["PodFailurePolicy"]}]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == "gpt"
    (worker,) = pod["containers"]
    # the installed train command; --resume: the JobSet restarts pods with this same command
    assert worker["command"] == ["msjax-train", *FLAGS, "--resume"] and "workingDir" not in worker
    env = {e["name"]: e for e in worker["env"]}
    assert env["MSJAX_REDIS_URL"]["value"] == "redis://gpt-redis.default.svc.cluster.local:6379/0"
    assert env["MSJAX_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "gpt-redis", "key": "password"}
    assert env["MSJAX_NUM_PROCESSES"]["value"] == "16" and env["MSJAX_RUN_ID"]["value"] == "run-7"
    assert env["MSJAX_ADVERTISE_HOST"]["value"] == "gpt-workers-0-$(JOB_INDEX).gpt"
    assert env["MSJAX_RANK"]["value"] == "$(JOB_INDEX)"  # pod 0 is rank 0, the coordinator
    names = [e["name"] for e in worker["env"]]
    assert names.index("JOB_INDEX") < min(names.index("MSJAX_ADVERTISE_HOST"), names.index("MSJAX_RANK"))
    assert worker["resources"]["limits"][resource] == "4" and "XLA_FLAGS" not in env
    if accelerator == "tpu":
        assert "cloud.google.com/gke-tpu-accelerator" in pod["nodeSelector"]


def test_k8s_supervised_manifest_has_the_controller_probes_and_self_checks(capsys):
    code, out, err = _launch(capsys, "--backend=k8s", "--num_processes=4", "--devices_per_process=2",
                             "--accelerator=none", "--image=msjax:test", "--run_id=run-9", "--supervise", "--",
                             *FLAGS, "--supervisor.restart_budget=2", "--supervisor.startup_timeout_s=90",
                             "--supervisor.heartbeat_period_s=2", flags=[])
    assert code == 0, err
    kinds = _by_kind([d for d in yaml.safe_load_all(out) if d])
    _check_schema(kinds)
    js, job, pod = _jobset_pod(kinds)
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 2  # the restart budget
    worker = pod["containers"][0]
    assert worker["command"][-1] == "--resume"
    env = {e["name"]: e for e in worker["env"]}
    assert env["XLA_FLAGS"]["value"] == "--xla_force_host_platform_device_count=2"  # accelerator none: CPU devices
    probe = worker["livenessProbe"]
    assert probe["exec"]["command"] == ["python", "-m", "msjax.control.probe"]
    assert probe["initialDelaySeconds"] == 90 and probe["periodSeconds"] == 2 and probe["failureThreshold"] == 1
    (init,) = pod["initContainers"]
    assert init["command"][:5] == ["python", "-m", "msjax.supervise.diagnostics", "--host", "$(MSJAX_HOST)"]
    assert "--fail_exit" in init["command"] and init["image"] == "msjax:test"
    assert {"MSJAX_HOST", "MSJAX_REDIS_URL", "MSJAX_REDIS_PASSWORD", "MSJAX_RUN_ID"} == {e["name"] for e in init["env"]}
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "msjax.dev/excluded", "operator": "DoesNotExist"} in term["matchExpressions"]
    (ctl_job,) = kinds["Job"]
    (ctl,) = ctl_job["spec"]["template"]["spec"]["containers"]
    assert ctl_job["metadata"]["name"] == "msjax-supervisor" and ctl["image"] == "msjax:test"
    assert ctl["command"][:4] == ["msjax-supervise", "--backend=k8s", "--num_processes=4", "--run_id=run-9"]
    assert "--accelerator=none" in ctl["command"] and "--devices_per_process=2" in ctl["command"]
    assert ctl["command"][ctl["command"].index("--") + 1:] == [*FLAGS, "--supervisor.restart_budget=2",
                                                               "--supervisor.startup_timeout_s=90",
                                                               "--supervisor.heartbeat_period_s=2"]
    assert {e["name"] for e in ctl["env"]} >= {"MSJAX_REDIS_URL", "MSJAX_REDIS_PASSWORD", "MSJAX_RUN_ID"}


def test_k8s_needs_an_image_and_submit_is_slurm_only(capsys):
    code, _, err = _launch(capsys, "--backend=k8s", "--num_processes=2")
    assert code == 2 and err.startswith("error: --backend=k8s needs --image")
    code, _, err = _launch(capsys, "--backend=k8s", "--num_processes=2", "--image=x", "--submit")
    assert code == 2 and "--submit: allowed with --backend=slurm only" in err


def _script_lines(script: str, tmp_path) -> list[str]:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    return script.splitlines()


def test_slurm_script(tmp_path, capsys):
    setup = tmp_path / "setup.sh"
    setup.write_text("module load cuda/12\n")
    code, script, err = _launch(
        capsys, "--backend=slurm", "--num_processes=8", "--devices_per_process=8", "--partition=a100",
        "--account=proj7", "--qos=high", "--workdir=/scratch/run", "--setup=source /opt/venv/bin/activate",
        f"--setup_file={setup}", "--sbatch=--mail-type=END,FAIL", "--sbatch", "--constraint=ib",
        "--srun_args=--container-image=nvcr.io/x:1", "--run_id=r1")
    assert code == 0, err
    lines = _script_lines(script, tmp_path)
    assert lines[0] == "#!/bin/bash"
    for directive in ("--nodes=8", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=a100",
                      "--account=proj7", "--qos=high", "--chdir=/scratch/run", "--mail-type=END,FAIL",
                      "--constraint=ib", "--requeue"):
        assert f"#SBATCH {directive}" in lines, directive
    assert "#SBATCH --no-kill" not in lines  # unsupervised: a node failure ends the job (and it is requeued)
    # the setup block runs before anything of msjax (Redis, the workers)
    first_msjax = next(i for i, line in enumerate(lines) if "msjax-" in line and not line.startswith("#"))
    assert lines.index("source /opt/venv/bin/activate") < lines.index("module load cuda/12") < first_msjax
    assert not any("scripts/" in line or line.startswith("cd ") for line in lines)  # no checkout needed
    redis = next(line for line in lines if "--overlap msjax-redis" in line)
    assert redis.startswith('srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" --overlap msjax-redis')
    # no fixed port, the first node's own address, no password on a command line
    assert '--port "$REDIS_PORT" --bind "$REDIS_BIND"' in redis and "requirepass" not in script
    assert lines.index("REDIS_PORT=$(msjax-redis --free-port)") < lines.index(redis)
    assert not any("COORDINATOR_PORT" in line or "6379" in line for line in lines)
    assert 'export MSJAX_RUN_ID="r1-${SLURM_JOB_ID}"' in lines
    (step,) = [line for line in lines if line.startswith("srun --nodes=\"$SLURM_NNODES\"")]
    words = shlex.split(step)
    assert "--container-image=nvcr.io/x:1" in words and "--kill-on-bad-exit=1" in words and "--label" in words
    i, pipe = words.index("msjax-worker"), words.index("|")
    assert words[i - 2:i] == ["-c", "$TASK_WRAPPER"] and words[i + 1:pipe] == ["msjax-train", *FLAGS, "${RESUME[@]}",
                                                                                "2>&1"]
    # the step's labelled output is split per rank and shown as `[rank R] ` lines (msjax.launch.output)
    assert words[pipe + 1:pipe + 3] == ["msjax-output", "--log_dir=runs/gpt_tiny/logs"], words[pipe:]  # train.run_dir
    assert "status=${PIPESTATUS[0]}" in lines
    assert 'export MSJAX_NUM_PROCESSES="$SLURM_NNODES"' in lines
    # the task wrapper fixes each task's rank to its SLURM_PROCID (rank 0, JAX's coordinator, on the first node)
    # and records its own exit status: run it as srun would, with `env` (then `exit 143`) as the command
    (wrapper,) = shlex.split(re.search(r"^TASK_WRAPPER=('(?:[^']|'\"'\"')*')$", script, re.M).group(1))
    task_env = {"SLURM_PROCID": "3", "SLURMD_NODENAME": "n3", "PATH": "/bin:/usr/bin",
                "MSJAX_TASK_STATUS": str(tmp_path)}
    ran = subprocess.run(["bash", "-c", wrapper, "msjax-worker", "env"], capture_output=True, text=True, env=task_env)
    assert ran.returncode == 0 and {"MSJAX_RANK=3", "MSJAX_HOST=n3"} <= set(ran.stdout.splitlines()), ran
    stopped = subprocess.run(["bash", "-c", wrapper, "msjax-worker", "bash", "-c", "exit 143"], env=task_env)
    assert stopped.returncode == 143 and (tmp_path / "rank3").read_text().strip() == "143"
    # requeued (SLURM_RESTART_COUNT > 0): --resume; a resumable stop (75, 130, 143): requeue itself
    assert 'RESUME=(); if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then RESUME=(--resume); fi' in lines
    # requeued only when every task stopped resumably itself (srun's own status cannot tell: a task it killed reads
    # like one stopped by SIGTERM)
    assert '    [[ " 75 130 143 " == *" $(cat "$MSJAX_TASK_STATUS/rank$r" 2>/dev/null) "* ]] || resumable=0' in lines
    assert '    JOB_STATE=$(scontrol show job "$SLURM_JOB_ID") && break' in lines
    assert 'if grep -q "JobState=RUNNING" <<<"$JOB_STATE"; then' in lines
    assert '    scontrol requeue "$SLURM_JOB_ID" && break' in lines


def test_slurm_supervised_script_runs_the_supervisor_with_spares_and_no_kill(tmp_path, capsys):
    code, script, err = _launch(capsys, "--backend=slurm", "--num_processes=2", "--devices_per_process=2",
                                "--accelerator=none", "--supervise", "--run_id=r2", "--",
                                *FLAGS, "--supervisor.spares=1", flags=[])
    assert code == 0, err
    lines = _script_lines(script, tmp_path)
    assert "#SBATCH --nodes=3" in lines and "#SBATCH --no-kill" in lines  # 2 hosts + 1 spare
    assert not [x for x in lines if x.startswith("srun") and "msjax-train" in x]  # the supervisor starts them
    (ctl,) = [x for x in lines if x.startswith("msjax-supervise")]
    words = shlex.split(ctl)
    assert words[:4] == ["msjax-supervise", "--backend=slurm", "--nodes=$NODES", "--run_id=$MSJAX_RUN_ID"]
    assert {"--num_processes=2", "--devices_per_process=2", "--accelerator=none"} <= set(words[:words.index("--")])
    assert words[words.index("--") + 1:] == [*FLAGS, "--supervisor.spares=1", "${RESUME[@]}"]
    assert 'resumable=0; if [[ " 75 130 143 " == *" $status "* ]]; then resumable=1; fi' in lines
    assert lines.index(ctl) > lines.index('export MSJAX_REDIS_URL="redis://${HEAD_NODE}:${REDIS_PORT}/0"')


@pytest.mark.parametrize("backend", ["slurm", "k8s", "local"])
def test_a_job_that_cannot_run_is_refused_before_anything_is_written_or_started(tmp_path, capsys, backend):
    """`--num_processes=2 -- --mesh.data=3` once rendered a job that could not run; now a mesh that does not
    match the devices is the trainer's own error (msjax.planner.preflight), and so is a batch that does not split
    over it and a model too large for the devices."""
    out = tmp_path / "spec"
    common = [f"--backend={backend}", "--num_processes=2", "--devices_per_process=1", "--accelerator=none",
              "--image=x", f"--output={out}", "--redis_port=1"]  # port 1: a local run would fail to start Redis
    code, stdout, err = _launch(capsys, *common, flags=["--mesh.data=4", f"--train.run_dir={tmp_path / 'run'}"])
    assert code == 2 and stdout == "", (stdout, err)
    assert err.startswith("error: gpt_tiny: mesh pipeline=1 x data=4") and "but 2 are present" in err, err
    code, stdout, err = _launch(capsys, *common, flags=["--mesh.data=3"])
    assert code == 2 and err == "error: microbatch of 16 sequences (train.global_batch=16 / train.microbatches=1) " \
                                "does not split over data x fsdp x expert = 3 devices\n", err
    code, stdout, err = _launch(capsys, *common, flags=["--config=gpt175b", "--mesh.data=-1"])
    assert code == 2 and "does not fit" in err and "per-device memory estimate" in err, err
    assert not out.exists() and not (tmp_path / "run").exists()
    # the same config on devices that fit renders
    if backend != "local":
        code, _, err = _launch(capsys, *common, flags=["--mesh.data=2"])
        assert code == 0 and out.exists(), err


def test_a_presets_remat_that_does_not_fit_the_job_is_raised_for_its_workers(tmp_path, capsys, caplog):
    """gpt530b on 2,240 A100s (MegaScale's layout, the preset's 35 microbatches of 8): its remat (none) does not
    fit, full is the cheapest that does; the launcher says so and its workers get --model.remat=full. A remat the
    user set is theirs: refused."""
    common = ["--backend=slurm", "--num_processes=280", "--devices_per_process=8", "--device_kind=a100-80g",
              f"--output={tmp_path / 'spec'}"]
    flags = ["--config=gpt530b", "--train.global_batch=2240", "--mesh.data=-1"]
    code, _, err = _launch(capsys, *common, flags=flags)
    assert code == 0, err
    assert "model.remat=full: none needs" in caplog.text and "full is the cheapest policy that fits" in caplog.text
    (step,) = [x for x in (tmp_path / "spec").read_text().splitlines() if x.startswith("srun --nodes=\"$SLURM_NNODES")]
    assert f"msjax-train {' '.join(flags)} --model.remat=full " in step, step
    code, _, err = _launch(capsys, *common, flags=[*flags, "--model.remat=none"])
    assert code == 2 and "does not fit" in err and "--model.remat=full" in err, err


def test_typed_overrides_become_worker_flags_that_parse_back_to_the_same_config():
    """A re-plan's overrides (dotted key -> typed value) reach a restarted worker as flags after the job's own
    (`worker_flags`), then --resume; parsed back they give the same config."""
    from msjax.config import Config, apply_overrides
    from msjax.launch.env import worker_flags

    over = {"mesh.data": 2, "mesh.tensor": 4, "mesh.fsdp_prefetch": True, "model.attention.window": None,
            "train.loggers": ("jsonl", "tensorboard"), "optimizer.lr": 3e-4, "mesh.rules": "tp"}
    flags = worker_flags(["--config=gpt_tiny", "--mesh.data=8"], over, resume=True)
    assert flags[:5] == ["--config=gpt_tiny", "--mesh.data=8", "--mesh.data=2", "--mesh.tensor=4",
                         "--mesh.fsdp_prefetch=true"]
    assert flags[-1] == "--resume" and worker_flags([], {}, resume=False) == []
    parsed = dict(f[2:].split("=", 1) for f in flags[2:-1])
    base = Config()
    assert apply_overrides(base, parsed) == apply_overrides(base, over)
