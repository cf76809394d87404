"""usecases"""
