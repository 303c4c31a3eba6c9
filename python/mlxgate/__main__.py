from mlxgate.cli import main

main()
