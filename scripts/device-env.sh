# Sourced at the start of a command on the lent NVIDIA machine (the `device`
# tool): unpacks the carried Vulkan loader (.gl, from
# ../shared/device/fetch-vulkan-debs.sh), points it at NVIDIA's ICD, and
# installs the carried flashport wheel (wheels/, from `maturin build
# --release -o wheels`) into /tmp/site.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ ! -e "$VK_DRIVER_FILES" ]; then
    # Older images ship only the EGL entry point of the driver.
    mkdir -p /tmp/icd
    printf '{"file_format_version":"1.0.0","ICD":{"library_path":"libEGL_nvidia.so.0","api_version":"1.3"}}\n' >/tmp/icd/nvidia.json
    export VK_DRIVER_FILES=/tmp/icd/nvidia.json LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
fi
export XDG_RUNTIME_DIR=/tmp/xdg-runtime PYTHONUNBUFFERED=1
mkdir -p -m 700 "$XDG_RUNTIME_DIR"
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site wheels/*.whl || return 1
export PYTHONPATH=/tmp/site
