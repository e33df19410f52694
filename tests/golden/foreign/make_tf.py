"""Write the TensorFlow golden checkpoints that tests/test_foreign_tf.py reads without TensorFlow.

Run once, by hand, with a throwaway virtualenv that has TensorFlow (never by the tests):

    python3.11 -m venv /tmp/venv-tf && /tmp/venv-tf/bin/pip install tensorflow-cpu numpy
    /tmp/venv-tf/bin/python tests/golden/foreign/make_tf.py

It writes, under tests/golden/foreign/tf/:

    tf2/tf_ckpts/       the TF checkpoint guide's example: tf.train.Checkpoint + CheckpointManager
    tf1/model.ckpt-42   a TF1 graph-mode Saver checkpoint (partitioned variable, several dtypes)
    tf1/sharded/        the same graph saved with Saver(sharded=True) over two CPU devices
    */expected.npz      every value as TensorFlow itself reads it back (tf.train.load_variable)
    */expected.json     tf.train.list_variables, tf.train.latest_checkpoint, library versions
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf")


def expected(prefix: str, out_dir: str, extra: dict) -> None:
    """What TensorFlow reads back from ``prefix``: the values into expected.npz, the rest into JSON."""
    listing = tf.train.list_variables(prefix)
    values = {}
    unreadable = {}  # what TensorFlow itself cannot turn into numpy (DT_VARIANT iterator state)
    strings = {}  # name -> shape of string tensors
    for name, _shape in listing:
        try:
            value = tf.train.load_variable(prefix, name)
        except tf.errors.OpError as e:
            unreadable[name] = e.message
            continue
        if isinstance(value, np.ndarray) and value.dtype != object:
            values[name] = value
        elif isinstance(value, bytes) or (isinstance(value, np.ndarray) and value.dtype == object):
            strings[name] = np.asarray(value, dtype=object).shape  # DT_STRING: no numpy form
        else:
            values[name] = np.asarray(value)
    stem = os.path.basename(prefix)
    np.savez(os.path.join(out_dir, f"{stem}.expected.npz"), **values)
    info = {
        "prefix": os.path.relpath(prefix, out_dir),
        "list_variables": [[name, list(shape)] for name, shape in listing],
        "dtypes": {name: str(v.dtype) for name, v in values.items()},
        "unreadable": unreadable,
        "strings": {name: list(shape) for name, shape in strings.items()},
        "versions": {"tensorflow": tf.__version__, "numpy": np.__version__, "python": sys.version.split()[0]},
        **extra,
    }
    with open(os.path.join(out_dir, f"{stem}.expected.json"), "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
        f.write("\n")


def make_tf2() -> None:
    """The guide's example, as written there (tensorflow.org/guide/checkpoint)."""
    out = os.path.join(HERE, "tf2")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    os.chdir(out)
    tf.random.set_seed(0)

    class Net(tf.keras.Model):
        """A simple linear model."""

        def __init__(self):
            super(Net, self).__init__()  # noqa: UP008
            self.l1 = tf.keras.layers.Dense(5)

        def call(self, x):
            return self.l1(x)

    net = Net()

    def toy_dataset():
        inputs = tf.range(10.0)[:, None]
        labels = inputs * 5.0 + tf.range(5.0)[None, :]
        return tf.data.Dataset.from_tensor_slices(dict(x=inputs, y=labels)).repeat().batch(2)

    def train_step(net, example, optimizer):
        """Trains `net` on `example` using `optimizer`."""
        with tf.GradientTape() as tape:
            output = net(example["x"])
            loss = tf.reduce_mean(tf.abs(output - example["y"]))
        variables = net.trainable_variables
        gradients = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(gradients, variables))
        return loss

    opt = tf.keras.optimizers.Adam(0.1)
    dataset = toy_dataset()
    iterator = iter(dataset)
    ckpt = tf.train.Checkpoint(step=tf.Variable(1), optimizer=opt, net=net, iterator=iterator)
    manager = tf.train.CheckpointManager(ckpt, "./tf_ckpts", max_to_keep=3)

    ckpt.restore(manager.latest_checkpoint)
    for _ in range(50):
        example = next(iterator)
        train_step(net, example, opt)
        ckpt.step.assign_add(1)
        if int(ckpt.step) % 10 == 0:
            manager.save()

    latest = tf.train.latest_checkpoint("tf_ckpts")
    extra = {
        "latest_checkpoint": os.path.relpath(latest, out),
        "manager_checkpoints": [os.path.relpath(p, out) for p in manager.checkpoints],
    }
    expected(os.path.join(out, "tf_ckpts", os.path.basename(latest)), out, extra)


def make_tf2_slots() -> None:
    """Optimizer slot variables as TF 2 wrote them before Keras 3 (``.OPTIMIZER_SLOT`` names):
    a tf.compat.v1 optimizer still tracks its slots that way."""
    out = os.path.join(HERE, "tf2_slots")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    model = tf.Module()
    model.w = tf.Variable([[1.0, -2.0], [0.5, 3.0]])
    model.b = tf.Variable([0.25, -0.75], dtype=tf.float64)
    opt = tf.compat.v1.train.AdamOptimizer(0.1)
    for _ in range(3):
        opt.minimize(lambda: tf.reduce_sum(model.w**2) + tf.cast(tf.reduce_sum(model.b**2), tf.float32))
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).save(os.path.join(out, "ckpt"))
    expected(prefix, out, {"latest_checkpoint": os.path.relpath(tf.train.latest_checkpoint(out), out)})


def make_tf1() -> None:
    """A TF1 graph-mode Saver checkpoint, and the same graph saved sharded over two devices."""
    out = os.path.join(HERE, "tf1")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.default_rng(0)
        with tf.device("/cpu:0"):
            kernel = v1.get_variable("dense/kernel", initializer=rng.standard_normal((3, 4)).astype(np.float32))
            bias = v1.get_variable("dense/bias", initializer=np.arange(4, dtype=np.float64) / 3)
            counts = v1.get_variable("counts", initializer=np.array([-(2**40), 0, 7, 2**62], dtype=np.int64))
            v1.get_variable("half", initializer=np.array([[1.5, -0.25], [65504, 1e-4]], dtype=np.float16))
            v1.get_variable("embed", initializer=tf.cast(tf.constant([[0.1, -2.0, 3.5]]), tf.bfloat16))
            v1.get_variable("flags", initializer=np.array([True, False, True]))
            v1.get_variable("scalar", initializer=np.float32(2.5))
            v1.get_variable("cplx", initializer=np.array([1 + 2j, -3.5j], dtype=np.complex64))
            v1.Variable([b"alpha", b"beta"], name="vocab")  # DT_STRING: listed, not read
            part = v1.get_variable(
                "part",
                shape=(10, 3),
                initializer=v1.random_normal_initializer(seed=1),
                partitioner=v1.fixed_size_partitioner(3),
            )
            step = v1.train.get_or_create_global_step()
        with tf.device("/cpu:1"):
            v1.get_variable("other_device", initializer=np.arange(6, dtype=np.int32).reshape(2, 3))
        assign = v1.assign(step, 42)
        # Relative names in the `checkpoint` file, so the fixtures read the same wherever they are.
        saver = v1.train.Saver(save_relative_paths=True)
        sharded = v1.train.Saver(sharded=True, save_relative_paths=True)
        config = v1.ConfigProto(device_count={"CPU": 2})
        with v1.Session(graph=graph, config=config) as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(assign)
            del kernel, bias, counts, part
            saver.save(sess, os.path.join(out, "model.ckpt"), global_step=42, write_meta_graph=False)
            os.makedirs(os.path.join(out, "sharded"))
            sharded.save(sess, os.path.join(out, "sharded", "model.ckpt"), global_step=42, write_meta_graph=False)
    extra = {"latest_checkpoint": os.path.relpath(tf.train.latest_checkpoint(out), out)}
    expected(os.path.join(out, "model.ckpt-42"), out, extra)
    sub = os.path.join(out, "sharded")
    extra = {"latest_checkpoint": os.path.relpath(tf.train.latest_checkpoint(sub), sub)}
    expected(os.path.join(sub, "model.ckpt-42"), sub, extra)


if __name__ == "__main__":
    make_tf1()
    make_tf2()
    make_tf2_slots()
