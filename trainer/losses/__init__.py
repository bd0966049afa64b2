"""trainer/losses"""
