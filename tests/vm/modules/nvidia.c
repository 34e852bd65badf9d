// SPDX-License-Identifier: GPL-2.0
/*
 * A stand-in for NVIDIA's `nvidia` module, for gpu-agent's VM test: it
 * registers a character device named "nvidia-frontend" (dynamic major, as
 * the real driver does), takes a parameter, writes the /proc/driver/nvidia
 * files gpu-agent reads (version, one GPU's information with its device
 * minor), and exports a symbol so that the other test modules depend on it
 * the way nvidia-uvm and nvidia-modeset depend on nvidia.
 */
#include <linux/fs.h>
#include <linux/module.h>
#include <linux/proc_fs.h>
#include <linux/seq_file.h>

static int NVreg_TestLevel = 1;
module_param(NVreg_TestLevel, int, 0444);
MODULE_PARM_DESC(NVreg_TestLevel, "a parameter for the VM test to set and read back");

static int frontend_major;
static struct proc_dir_entry *proc_nvidia;

int gpu_agent_test_frontend_major(void)
{
	return frontend_major;
}
EXPORT_SYMBOL(gpu_agent_test_frontend_major);

static int frontend_open(struct inode *inode, struct file *file)
{
	return 0;
}

static const struct file_operations frontend_fops = {
	.owner = THIS_MODULE,
	.open = frontend_open,
};

#ifndef GPU_AGENT_TEST_VERSION
#define GPU_AGENT_TEST_VERSION "550.127.08"
#endif

static int version_show(struct seq_file *m, void *v)
{
	seq_puts(m, "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  " GPU_AGENT_TEST_VERSION
		    "  Release Build  (gpu-agent VM test)\n");
	return 0;
}

static int information_show(struct seq_file *m, void *v)
{
	seq_puts(m, "Model: \t\t gpu-agent VM test device\n"
		    "GPU UUID: \t GPU-00000000-0000-0000-0000-0000000000a1\n"
		    "Device Minor: \t 0\n");
	return 0;
}

static int __init nvtest_init(void)
{
	frontend_major = register_chrdev(0, "nvidia-frontend", &frontend_fops);
	if (frontend_major < 0)
		return frontend_major;
	proc_nvidia = proc_mkdir("driver/nvidia", NULL);
	if (proc_nvidia) {
		struct proc_dir_entry *gpus = proc_mkdir("gpus", proc_nvidia);
		struct proc_dir_entry *gpu = gpus ? proc_mkdir("0000:00:05.0", gpus) : NULL;

		proc_create_single("version", 0444, proc_nvidia, version_show);
		if (gpu)
			proc_create_single("information", 0444, gpu, information_show);
	}
	pr_info("gpu-agent-test: nvidia " GPU_AGENT_TEST_VERSION " loaded, major %d, NVreg_TestLevel=%d\n",
		frontend_major, NVreg_TestLevel);
	return 0;
}

static void __exit nvtest_exit(void)
{
	proc_remove(proc_nvidia);
	unregister_chrdev(frontend_major, "nvidia-frontend");
	pr_info("gpu-agent-test: nvidia unloaded\n");
}

module_init(nvtest_init);
module_exit(nvtest_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("gpu-agent VM test stand-in for nvidia.ko");
