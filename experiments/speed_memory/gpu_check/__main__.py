from experiments.speed_memory.gpu_check.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
