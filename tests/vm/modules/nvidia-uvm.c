// SPDX-License-Identifier: GPL-2.0
/*
 * A stand-in for `nvidia-uvm` (module nvidia_uvm) for gpu-agent's VM test:
 * a character device named "nvidia-uvm", and a dependency on the test
 * `nvidia` module through its exported symbol.
 */
#include <linux/fs.h>
#include <linux/module.h>

extern int gpu_agent_test_frontend_major(void);

static int uvm_major;

static int uvm_open(struct inode *inode, struct file *file)
{
	return 0;
}

static const struct file_operations uvm_fops = {
	.owner = THIS_MODULE,
	.open = uvm_open,
};

static int __init uvm_init(void)
{
	uvm_major = register_chrdev(0, "nvidia-uvm", &uvm_fops);
	if (uvm_major < 0)
		return uvm_major;
	pr_info("gpu-agent-test: nvidia_uvm loaded, major %d, frontend %d\n", uvm_major,
		gpu_agent_test_frontend_major());
	return 0;
}

static void __exit uvm_exit(void)
{
	unregister_chrdev(uvm_major, "nvidia-uvm");
	pr_info("gpu-agent-test: nvidia_uvm unloaded\n");
}

module_init(uvm_init);
module_exit(uvm_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("gpu-agent VM test stand-in for nvidia-uvm.ko");
