from volunteer.cli import main

main()
