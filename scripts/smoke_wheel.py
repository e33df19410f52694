"""The wheel, installed outside the checkout, works: run by scripts/smoke_wheel.sh (`make smoke`).

It runs with the fresh virtualenv's Python, in an empty folder outside the repository, and checks:
the wheel holds every module of the source tree and py.typed, and nothing else; jaxckpt imports from
the virtualenv; an NNX module saves and restores; the `jaxckpt` console script lists and verifies;
the golden checkpoints of every format version read back as written.

With ``--checkout`` instead of ``--wheel`` (a clone installed with ``pip install ".[flax]"``), it checks
that the installed package holds every module of the source tree, imports from the virtualenv, saves
and restores, and that the console script works.
"""

import argparse
import email.parser
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import numpy as np


def check(condition, message):
    if not condition:
        sys.exit(f"smoke: FAILED: {message}")


def check_wheel(wheel: Path, source: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(z.read(metadata_name).decode())
    dist_info = metadata_name.rsplit("/", 1)[0]
    modules = {f"jaxckpt/{p.relative_to(source).as_posix()}" for p in source.rglob("*.py")}
    missing = sorted(modules - names)
    check(not missing, f"the wheel lacks {missing}")
    check("jaxckpt/py.typed" in names, "the wheel lacks jaxckpt/py.typed")
    stray = sorted(n for n in names if not n.startswith(("jaxckpt/", dist_info + "/")))
    check(not stray, f"the wheel holds files outside the package: {stray}")
    extra = sorted(n for n in names if n.startswith("jaxckpt/") and n not in modules | {"jaxckpt/py.typed"})
    check(not extra, f"the wheel holds files that are not in the source tree: {extra}")
    check(f"{dist_info}/licenses/LICENSE" in names, "the wheel lacks its LICENSE")
    check(metadata["License-Expression"] == "Apache-2.0", f"License-Expression is {metadata['License-Expression']}")
    check(metadata["Requires-Python"] == ">=3.11", f"Requires-Python is {metadata['Requires-Python']}")
    print(f"wheel: {wheel.name}: {len(modules)} modules, py.typed, LICENSE; {len(names)} files")
    return metadata["Version"]


def check_installed(checkout: Path, source: Path) -> str:
    """The package that pip built from a clone: every module of the source tree; its version."""
    import jaxckpt

    where = Path(jaxckpt.__file__).resolve().parent
    installed = {p.relative_to(where).as_posix() for p in where.rglob("*.py")}
    modules = {p.relative_to(source).as_posix() for p in source.rglob("*.py")}
    missing = sorted(modules - installed)
    check(not missing, f"the install from the clone lacks {missing}")
    version = re.search(r'__version__ = "([^"]+)"', (checkout / "jaxckpt" / "_version.py").read_text())
    check(version is not None, "no __version__ in the clone's jaxckpt/_version.py")
    print(f"clone: {checkout} installed: {len(modules)} modules")
    return version[1]


def check_import(version: str):
    import jaxckpt

    where = Path(jaxckpt.__file__).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    check(where.is_relative_to(site), f"jaxckpt imported from {where}, not from {site}")
    check(jaxckpt.__version__ == version, f"jaxckpt.__version__ {jaxckpt.__version__} != the wheel's {version}")
    check((where.parent / "py.typed").is_file(), "py.typed is not installed")
    print(f"import: jaxckpt {jaxckpt.__version__} from {where.parent}")


def check_nnx():
    import optax
    from flax import nnx

    import jaxckpt

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 4, rngs=rngs)

    net = Net(nnx.Rngs(0))
    path = jaxckpt.save("model", net)
    other = Net(nnx.Rngs(1))
    check(not np.array_equal(other.l1.kernel[...], net.l1.kernel[...]), "two seeds gave the same kernel")
    jaxckpt.restore(path, like=other)
    check(np.array_equal(other.l1.kernel[...], net.l1.kernel[...]), "the restored kernel differs")
    check(np.array_equal(other.l1.bias[...], net.l1.bias[...]), "the restored bias differs")

    optimizer = nnx.Optimizer(net, optax.adam(0.1), wrt=nnx.Param)
    ckpt = jaxckpt.Checkpoint(step=0, net=net, optimizer=optimizer)
    with jaxckpt.CheckpointManager(ckpt, "ckpts", max_to_keep=2, step_counter="step") as manager:
        for _ in range(3):
            ckpt.step += 1
            manager.save(metrics={"loss": 1.0 / ckpt.step})
    fresh = Net(nnx.Rngs(2))
    again = jaxckpt.Checkpoint(step=0, net=fresh, optimizer=nnx.Optimizer(fresh, optax.adam(0.1), wrt=nnx.Param))
    again.restore(jaxckpt.latest_checkpoint("ckpts")).assert_consumed()
    check(again.step == 3, f"restored step {again.step}")
    check(np.array_equal(fresh.l1.kernel[...], net.l1.kernel[...]), "the manager's restored kernel differs")
    print(f"nnx: saved and restored a module ({path}) and a manager's checkpoints (ckpts)")


def run_cli(*args) -> str:
    script = Path(sys.executable).parent / "jaxckpt"  # the console script of this virtualenv
    check(script.is_file(), f"no console script at {script}")
    done = subprocess.run([str(script), *args], capture_output=True, text=True)
    check(done.returncode == 0, f"jaxckpt {' '.join(args)} exited {done.returncode}: {done.stderr}")
    print(f"$ jaxckpt {' '.join(args)}\n{done.stdout.rstrip()}")
    return done.stdout


def check_no_extra_needed(golden: Path):
    """jaxckpt and its command import neither flax nor optax: they work without the flax extra."""
    code = (
        "import sys, jaxckpt, jaxckpt.tools.cli\n"
        f"assert jaxckpt.tools.cli.main(['ls', {str(golden / 'v2')!r}]) == 0\n"
        "jaxckpt.restore(" + repr(str(golden / "v2")) + ")\n"
        "extras = sorted({m.split('.')[0] for m in sys.modules} & {'flax', 'optax'})\n"
        "assert not extras, extras\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    check(done.returncode == 0, f"jaxckpt without the flax extra: {done.stderr}")
    print("no extra: import, restore and jaxckpt ls import neither flax nor optax")


def check_golden(golden: Path):
    import jaxckpt

    sys.path.insert(0, str(golden))
    from make_golden import golden_tree

    expected = golden_tree()
    versions = sorted(golden.glob("v*"))
    # Every version a single folder shows: version 6 adds references between a bucket manager's
    # checkpoints (tests/test_bucket_incremental.py), and a plain save still writes PLAIN_VERSION.
    from jaxckpt.format.records import PLAIN_VERSION

    check([v.name for v in versions] == [f"v{i}" for i in range(1, PLAIN_VERSION + 1)], f"{versions}")
    for folder in versions:
        restored = jaxckpt.restore(folder)
        check(restored["big"].tobytes() == expected["big"].tobytes(), f"{folder.name}: big differs")
        check(restored["bf16"].dtype == expected["bf16"].dtype, f"{folder.name}: bf16 dtype")
        check(restored["step"] == expected["step"], f"{folder.name}: step differs")
        like = jaxckpt.restore(folder, like=expected)
        check(like["net"]["l1"]["kernel"].tobytes() == expected["net"]["l1"]["kernel"].tobytes(), folder.name)
        check(type(like["pair"]).__name__ == "Pair", f"{folder.name}: the namedtuple was not rebuilt")
    print(f"golden: {', '.join(v.name for v in versions)} read back as written")


def check_foreign(foreign: Path):
    """Other libraries' checkpoints read from the installed wheel (its jaxckpt.interop.formats package)."""
    import jaxckpt

    check(jaxckpt.load_variable(foreign / "tf/tf2/tf_ckpts", "step") == 50, "the TF2 guide checkpoint's step")
    check(jaxckpt.latest_checkpoint(foreign / "orbax/run").endswith("30"), "the Orbax run's latest step")
    run_cli("ls", str(foreign / "safetensors/model.safetensors"))
    run_cli("convert", str(foreign / "tf/tf1/model.ckpt-42"), "from_tf1")
    run_cli("convert", "from_tf1", "from_tf1.safetensors")
    run_cli("verify", "from_tf1.safetensors")
    print("foreign: TensorFlow, Orbax and safetensors read; converted to jaxckpt and to safetensors")


def main():
    parser = argparse.ArgumentParser()
    installed = parser.add_mutually_exclusive_group(required=True)
    installed.add_argument("--wheel", type=Path, help="the wheel installed")
    installed.add_argument("--checkout", type=Path, help="the clone installed (pip install .)")
    parser.add_argument("--source", type=Path, required=True, help="the checkout's jaxckpt/ folder")
    parser.add_argument("--golden", type=Path, required=True, help="a copy of tests/golden")
    args = parser.parse_args()
    check(not Path("jaxckpt").exists() and Path.cwd() != args.source.parent, "run this outside the checkout")

    if args.checkout is not None:
        check_import(check_installed(args.checkout, args.source))
        check_nnx()
        check("* ckpt-3" in run_cli("ls", "ckpts"), "jaxckpt ls ckpts")
        run_cli("verify", "ckpts")
        check_no_extra_needed(args.golden)
        print("smoke: all checks passed (the clone)")
        return
    version = check_wheel(args.wheel, args.source)
    check_import(version)
    check_nnx()
    listing = run_cli("ls", "ckpts")
    check("* ckpt-3" in listing and "ckpt-1" not in listing, "jaxckpt ls ckpts")
    tree = run_cli("ls", "model")
    check("l1" in tree and f"written by jaxckpt {version}" in tree, "jaxckpt ls model")
    run_cli("verify", "ckpts")
    for folder in sorted(args.golden.glob("v*")):
        run_cli("verify", str(folder))
    check_golden(args.golden)
    check_foreign(args.golden / "foreign")
    check_no_extra_needed(args.golden)
    print("smoke: all checks passed")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
