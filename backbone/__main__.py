from backbone.cli import main

main()
