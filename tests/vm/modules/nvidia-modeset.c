// SPDX-License-Identifier: GPL-2.0
/*
 * A stand-in for `nvidia-modeset` (module nvidia_modeset) for gpu-agent's VM
 * test: it only depends on the test `nvidia` module (the real one has no
 * device of its own either: /dev/nvidia-modeset is minor 254 of the frontend).
 */
#include <linux/module.h>

extern int gpu_agent_test_frontend_major(void);

static int __init modeset_init(void)
{
	pr_info("gpu-agent-test: nvidia_modeset loaded, frontend %d\n",
		gpu_agent_test_frontend_major());
	return 0;
}

static void __exit modeset_exit(void)
{
	pr_info("gpu-agent-test: nvidia_modeset unloaded\n");
}

module_init(modeset_init);
module_exit(modeset_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("gpu-agent VM test stand-in for nvidia-modeset.ko");
