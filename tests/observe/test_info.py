"""fdp info: versions, platform, devices, environment and collectives for a bug report."""

import importlib.metadata
import json
import platform

import jax
from _procs import run

import fdp

PACKAGES = ["jax", "jaxlib", "flax", "optax", "chex", "orbax-checkpoint", "msgpack", "numpy"]


def test_info_reports_versions_devices_and_collectives():
    report = fdp.info()
    versions = report["versions"]
    assert versions["python"] == platform.python_version()
    assert versions["fdp"] == fdp.__version__
    for name in PACKAGES:
        assert versions[name] == importlib.metadata.version(name), name
    backend = report["jax"]
    assert backend["platform"] == "cpu" and backend["device_count"] == 8
    assert backend["process_index"] == 0 and backend["process_count"] == 1
    assert backend["cpu_collectives"] == str(jax.config.jax_cpu_collectives_implementation)
    text = fdp.format_info(report)
    assert text.startswith("versions:\n  python ")
    assert ["jax", versions["jax"]] in [line.split() for line in text.splitlines()]


def test_cli_info_prints_versions_and_the_variables_that_matter(marker):
    env = {
        "FDP_DEBUG": "INFO",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "RANK": "3",
        "FDP_API_TOKEN": "do-not-print-me",
        "UNRELATED_VARIABLE": "x",
    }
    out = run(["-m", "fdp", "info"], marker, timeout=120, **env)
    assert out.returncode == 0, out.output
    lines = [line.split() for line in out.stdout.splitlines()]
    for name in ["fdp", "jaxlib", "flax", "optax", "chex"]:
        assert [name, fdp.__version__ if name == "fdp" else importlib.metadata.version(name)] in (
            lines
        )
    assert ["device_count", "4"] in lines and ["platform", "cpu"] in lines
    assert ["FDP_DEBUG", "INFO"] in lines and ["RANK", "3"] in lines
    assert ["XLA_FLAGS", "--xla_force_host_platform_device_count=4"] in lines
    assert ["FDP_API_TOKEN", "<hidden>"] in lines and "do-not-print-me" not in out.stdout
    assert "UNRELATED_VARIABLE" not in out.stdout
    assert ["cpu_collectives", str(jax.config.jax_cpu_collectives_implementation)] in lines

    out = run(["-m", "fdp", "info", "--json"], marker, timeout=120, **env)
    assert out.returncode == 0, out.output
    report = json.loads(out.stdout)
    assert report["jax"]["device_count"] == 4 and report["environment"]["RANK"] == "3"


def test_credentials_in_values_are_hidden_wherever_the_variable():
    """Names alone missed FDP_COORDINATOR_ADDRESS=user:pw@host and FDP_HF_AUTH=..."""
    from fdp.observe._info import environment

    token = "hf_" + "0123456789abcdefABCDEF" * 2
    env = environment(
        {
            "FDP_COORDINATOR_ADDRESS": "alice:pa55word@10.0.0.1:29500",
            "FDP_HF_AUTH": "short",
            "FDP_DATA": f"https://bob:s3cret@hub.example/data?token={token}",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_dump_to=/tmp/x",
            "MASTER_ADDR": "[::1]",
            "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        }
    )
    assert env["FDP_COORDINATOR_ADDRESS"] == "<hidden>@10.0.0.1:29500"
    assert env["FDP_HF_AUTH"] == "<hidden>"
    assert env["FDP_DATA"] == "https://<hidden>@hub.example/data?token=<hidden>"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4 --xla_dump_to=/tmp/x"
    assert (env["MASTER_ADDR"], env["JAX_COORDINATOR_ADDRESS"]) == ("[::1]", "10.0.0.1:1234")
    assert not any(s in str(env) for s in ("pa55word", "s3cret", token, "short"))


def test_variables_set_by_import_jax_are_left_out():
    """`import jax` sets TF_CPP_MIN_LOG_LEVEL=1 and TPU_SKIP_MDS_QUERY=1: not the user's doing."""
    from fdp.observe._info import environment

    set_by_jax = {"TF_CPP_MIN_LOG_LEVEL": "1", "TPU_SKIP_MDS_QUERY": "1"}
    assert environment(set_by_jax) == {}
    assert environment({"TF_CPP_MIN_LOG_LEVEL": "0"}) == {"TF_CPP_MIN_LOG_LEVEL": "0"}
