# Sourced by gpu_tables.sh and gpu_tests.sh: the device machine's environment from the carried kit (.device/, written
# by make_kit.py here).  `use_kit LOG` installs .device/whl/*.whl with $PYTHON's pip into SITE (/tmp/site) and puts it
# ahead of the checkout on PYTHONPATH, so that every package the image lacks (hydra-core, omegaconf, fastapi...) and
# the carried timm over the image's come from the kit; says the machine reaches no hub (HF_HUB_OFFLINE=1); points
# the mini tasks at the kit's Fashion-MNIST where it carries one.  A kit that does not install is exit 3, a wasted
# call: said in LOG.
#
# The GPU mode always uses the kit.  KIT=1 makes the --cpu mode use it too: with a python like the machine's (3.12,
# its own torch, timm, peft, accelerate and nothing of petl's configuration or serving stack) that is the device call
# rehearsed here (benchmarks/device/README.md, "Rehearsing the call").
SITE=${SITE:-/tmp/site}

use_kit() {
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .device/whl/*.whl || { echo "no kit: run make_kit.py wheels here and carry .device" | tee -a "$1"; exit 3; }
    export PYTHONPATH=$SITE:$PWD
    # The machine reaches no hub: said up front, as HF_HUB_OFFLINE=1, instead of each process (and each server or
    # worker it starts) finding out from a DNS lookup and a connection that may take seconds to fail.
    export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
    # The mini tasks' Fashion-MNIST, where the kit carries it (make_kit.py data): the machine has no apt package.
    if [ -d .device/fmnist ]; then
        export PETL_FASHION_MNIST_DIR=${PETL_FASHION_MNIST_DIR:-$PWD/.device/fmnist}
    fi
}
