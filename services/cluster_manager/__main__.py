from services.cluster_manager.service import create
from shared.runner import run_service

if __name__ == "__main__":
    run_service("cluster_manager", create)
