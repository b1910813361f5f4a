from services.job_executor.service import create
from shared.runner import run_service

if __name__ == "__main__":
    run_service("job_executor", create)
