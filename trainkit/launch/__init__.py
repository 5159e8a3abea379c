"""What the launcher asked for, the machine it runs on, and how a rank's life ends.

    launcher.py        the launch read from the environment or an Accelerate YAML; YAML lint; machine checks
    hardware.py        CPU threads per process; the peak FLOP/s that MFU is measured against
    hostfile.py        DeepSpeed's hostfile launch: its pre-flight, and `python -m trainkit.launch.hostfile`, which
                       sends the hosts only the allow-listed environment
    rank_exit.py       a lost peer recognised and named; an exit that a launched rank survives
    library_noise.py   the library messages silenced at their source, each with its reason
    train_process.py   train.py as a child process: its command under a launcher, run to its end or a time limit

May import the spine (errors, command_line) and run/output_folder.py (the stop record a hostfile launch reads).
"""
