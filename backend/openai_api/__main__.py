from backend.openai_api.server import main

if __name__ == "__main__":
    main()
