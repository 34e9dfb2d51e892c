from tandem_inference.tinker.main import main

if __name__ == "__main__":
    main()
