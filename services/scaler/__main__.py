from services.scaler.service import create
from shared.runner import run_service

if __name__ == "__main__":
    run_service("scaler", create)
