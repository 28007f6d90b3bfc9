from ftbench.cli import main

main()
